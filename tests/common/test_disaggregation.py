"""The split-or-not arithmetic: ratios, bandwidths, the verdict's rule and reasons, the prediction."""

from __future__ import annotations

import pytest

from plimsoll.disaggregation import (
    AGGREGATED,
    LayoutFigures,
    Ratio,
    ServiceProfile,
    parse_bandwidth,
    parse_ratios,
    predict,
    profile_from_report,
    verdict,
)


def test_ratios_and_bandwidths_parse_or_say_how() -> None:
    assert parse_ratios("1:1, 1P:2D,2p:1d") == [Ratio(1, 1), Ratio(1, 2), Ratio(2, 1)]
    assert Ratio(1, 2).name == "1P:2D" and Ratio(1, 2).replicas == 3
    with pytest.raises(ValueError, match="write PREFILL:DECODE"):
        parse_ratios("1:0")
    assert parse_bandwidth("10GB/s") == 10e9
    assert parse_bandwidth("400Gbps") == 50e9
    assert parse_bandwidth("25Gbit/s") == 25e9 / 8
    assert parse_bandwidth("1GiB/s") == 2**30
    with pytest.raises(ValueError, match="10GB/s"):
        parse_bandwidth("fast")


def layout(name: str, replicas: int, goodput: float, **kw: float) -> LayoutFigures:
    return LayoutFigures(name, replicas, goodput, **kw)  # type: ignore[arg-type]


def test_the_verdict_splits_only_beyond_the_margin_and_says_why() -> None:
    agg = layout(AGGREGATED, 2, 2.0, ttft_p95_s=0.4, tpot_p50_s=0.08)
    better = layout("1P:1D", 2, 2.6, ttft_p95_s=0.5, tpot_p50_s=0.03, transfer_s=0.004, transfer_bytes=2e6)
    v = verdict([agg, better])
    assert (v.choice, v.ratio, v.runs) == ("split", "1P:1D", "1P:1D")
    assert "30% more good requests per replica" in v.reasons[-2]
    assert "TPOT p50 30 ms split vs 80 ms aggregated" in v.reasons[-1]
    assert "KV transfer 4 ms and 2 MB per request" in v.reasons[1]

    close = layout("1P:1D", 2, 2.05)
    v = verdict([agg, close])
    assert v.choice == AGGREGATED and "within 5%" in v.reasons[-1]

    # Per replica: 3 replicas at 2.4 req/s is 0.8 each, worse than 1.0 aggregated.
    worse = layout("1P:2D", 3, 2.4, ttft_p95_s=0.9, transfer_s=0.25)
    v = verdict([agg, worse])
    assert v.choice == AGGREGATED and v.runs == AGGREGATED
    assert "20% fewer good requests per replica" in v.reasons[-2]
    assert "TTFT p95 grows to 900 ms" in v.reasons[-1] and "waits 250 ms for its KV blocks" in v.reasons[-1]
    with pytest.raises(ValueError, match="aggregated layout with at least one split"):
        verdict([agg])


PROFILE = ServiceProfile(
    prefill_tokens_per_s=10_000, decode_sequences=64, decode_tpot_s=0.02, kv_bytes_per_token=1e5
)


def test_prediction_splits_when_prefill_stalls_cap_aggregated() -> None:
    # Long prompts under a tight TPOT SLO: an aggregated replica may prefill only 20% of the time.
    layouts = predict(PROFILE, 4000, 200, parse_bandwidth("50GB/s"), [Ratio(1, 1), Ratio(2, 1), Ratio(3, 1)],
                      ttft_slo_s=2.0, tpot_slo_s=0.025)  # fmt: skip
    agg = layouts[0]
    assert agg.goodput_rps == pytest.approx(0.2 / 0.4) and "prefill stalls" in (agg.limited_by or "")
    v = verdict(layouts)
    assert v.choice == "split" and v.ratio == "3P:1D"
    assert layouts[3].limited_by == "the prefill pool"
    assert layouts[3].transfer_bytes == 4e8 and layouts[3].transfer_s == pytest.approx(0.008)


def test_prediction_keeps_aggregated_on_a_slow_link_or_a_loose_slo() -> None:
    ratios = [Ratio(1, 1), Ratio(2, 1), Ratio(3, 1)]
    slow = predict(PROFILE, 4000, 200, parse_bandwidth("1Gbit/s"), ratios, ttft_slo_s=2.0, tpot_slo_s=0.025)
    v = verdict(slow)
    assert v.choice == AGGREGATED
    assert all(lay.goodput_rps == 0 for lay in slow[1:]) and "with the transfer" in (slow[1].limited_by or "")
    # No TPOT SLO: nothing caps an aggregated replica's prefill share, and no ratio beats it per replica.
    loose = predict(PROFILE, 4000, 200, parse_bandwidth("50GB/s"), ratios)
    assert verdict(loose).choice == AGGREGATED
    assert max(lay.goodput_per_replica for lay in loose[1:]) <= loose[0].goodput_per_replica + 1e-12


def test_a_profile_from_a_sweep_report() -> None:
    def level(c: int, ttft_ms: float, tpot_ms: float, valid: bool = True) -> dict[str, object]:
        return {"concurrency": c, "valid": valid, "tokens": {"prompt_mean": 500.0},
                "latency_ms": {"ttft": {"p50": ttft_ms}, "tpot": {"p50": tpot_ms}}}  # fmt: skip

    report = {
        "levels": [level(4, 90, 30), level(1, 50, 20), level(8, 200, 45), level(16, 400, 60, valid=False)]
    }
    p = profile_from_report(report, kv_bytes_per_token=2048, tpot_slo_s=0.04)
    assert (p.prefill_tokens_per_s, p.decode_sequences, p.decode_tpot_s) == (10_000, 4, 0.03)
    assert profile_from_report(report, 2048).decode_sequences == 8
    with pytest.raises(ValueError, match="no level of the report meets the TPOT SLO"):
        profile_from_report(report, 2048, tpot_slo_s=0.01)
    # The server's own prefill rate, when the bench scraped it, is preferred over the end-to-end TTFT.
    report["levels"][1]["server"] = {"load": {"prefill_tokens_per_s": 25_000.0}}
    assert profile_from_report(report, 2048).prefill_tokens_per_s == 25_000
