"""Per-request formulas and level gates on hand-built records."""

import pytest

from plimsoll.bench.client import RequestRecord
from plimsoll.bench.config import SLO, BenchConfig
from plimsoll.bench.loadgen import LevelRun
from plimsoll.bench.stats import achieved_concurrency, meets_slo, summarize_level, window_throughput


def record(i: int, sent: float, ttft: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    rec = RequestRecord(i, scheduled=sent, sent=sent, measured=True)
    if error:
        rec.error_kind, rec.error_message = error, "boom"
        return rec
    t = sent + ttft
    rec.first_token = t
    rec.chunk_times = [t]
    for g in gaps:
        t += g
        rec.chunk_times.append(t)
    rec.end = t
    rec.output_tokens = len(rec.chunk_times)
    rec.prompt_tokens = 10
    return rec


def test_tpot_ttft_e2e_itl_by_formula() -> None:
    rec = record(0, 1.0, 0.2, [0.05, 0.05, 0.11])
    assert rec.ttft == pytest.approx(0.2)
    assert rec.e2e == pytest.approx(0.41)
    assert rec.tpot == pytest.approx((0.41 - 0.2) / 3)  # (E2E − TTFT)/(n − 1)
    assert rec.itls() == pytest.approx([0.05, 0.05, 0.11])
    assert record(1, 0.0, 0.1, []).tpot is None  # one token: no TPOT


def test_goodput_attainment_and_error_gate() -> None:
    cfg = BenchConfig(url="http://127.0.0.1:1", slo=SLO(ttft_p95_ms=150), max_client_lag_ms=1e9)
    recs = [record(i, 0.1 * i, 0.1 if i % 2 else 0.2, [0.01] * 3) for i in range(10)]
    recs.append(record(10, 0.5, 0, [], error="http_500"))
    run = LevelRun(2, None, 0, 0.0, 0.0, 2.0, recs)
    assert [meets_slo(r, cfg.slo) for r in recs[:2]] == [False, True]
    lv = summarize_level([run], cfg)
    assert lv["slo_attainment"] == pytest.approx(0.5)
    assert lv["requests"]["errors_by_kind"] == {"http_500": 1}
    assert lv["requests"]["error_rate"] == pytest.approx(1 / 11)
    assert not lv["valid"] and any("error rate" in r for r in lv["invalid_reasons"])


def test_window_throughput_counts_only_tokens_inside_the_window() -> None:
    rec = record(0, 0.0, 0.5, [0.5, 0.5, 0.5])  # tokens at 0.5, 1.0, 1.5, 2.0
    run = LevelRun(1, None, 0, 0.0, 0.75, 1.75, [rec])
    thr = window_throughput(run)
    assert thr["output_tokens_per_s"] == pytest.approx(2.0)  # tokens at 1.0 and 1.5 in a 1 s window
    assert thr["requests_per_s"] == 0.0  # it ends after the window
    assert achieved_concurrency(run) == pytest.approx(1.0)
