"""The split-or-not arithmetic: ratios, bandwidths, the verdict's rule and reasons, the prediction."""

from __future__ import annotations

import math

import pytest

from plimsoll.disaggregation import (
    AGGREGATED,
    MARGIN,
    NO_CLEAR_GAIN,
    SPLIT,
    LayoutFigures,
    Ratio,
    ServiceProfile,
    aggregated_at,
    noise_band,
    parse_bandwidth,
    parse_ratios,
    predict,
    profile_from_report,
    pull_stall_for,
    split_at,
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


def test_the_verdict_splits_only_beyond_the_band_and_says_why() -> None:
    agg = layout(AGGREGATED, 2, 2.0, ttft_p95_s=0.4, tpot_p50_s=0.08)
    better = layout("1P:1D", 2, 2.6, ttft_p95_s=0.5, tpot_p50_s=0.03, transfer_s=0.004, transfer_bytes=2e6)
    v = verdict([agg, better])
    assert (v.choice, v.ratio, v.runs, v.category, v.band) == ("split", "1P:1D", "1P:1D", SPLIT, MARGIN)
    assert "30% more good requests per replica than aggregated, beyond the noise band (10%)" in v.reasons[-2]
    assert "TPOT p50 30 ms split vs 80 ms aggregated" in v.reasons[-1]
    assert "KV transfer 4 ms and 2 MB per request" in v.reasons[1]

    # 8% ahead is inside the 10% band: no clear gain, and the simpler layout stays.
    close = layout("1P:1D", 2, 2.16)
    v = verdict([agg, close])
    assert (v.category, v.runs) == (NO_CLEAR_GAIN, AGGREGATED)
    assert v.reasons[-1].startswith("no clear gain: stay aggregated (simpler): the best split (1P:1D) is +8%")

    # Per replica: 3 replicas at 2.4 req/s is 0.8 each, 20% worse than 1.0 aggregated.
    worse = layout("1P:2D", 3, 2.4, ttft_p95_s=0.9, transfer_s=0.25)
    v = verdict([agg, worse])
    assert (v.category, v.runs) == (AGGREGATED, AGGREGATED)
    assert "20% fewer good requests per replica" in v.reasons[-2]
    assert "TTFT p95 grows to 900 ms" in v.reasons[-1] and "waits 250 ms for its KV blocks" in v.reasons[-1]
    with pytest.raises(ValueError, match="aggregated layout with at least one split"):
        verdict([agg])


def test_the_measured_band_widens_with_the_repeats_spread() -> None:
    # Paired differences (split - aggregated) / 1.0: 0.3, -0.1, 0.5, -0.1 -> mean 0.15, sample stdev 0.3,
    # standard error 0.15, band 2 x 0.15 = 30%: a 15% lead that flips sign between repeats is no clear gain.
    agg_runs, split_runs = [1.0, 1.0, 1.0, 1.0], [1.3, 0.9, 1.5, 0.9]
    band, text = noise_band(agg_runs, split_runs)
    assert band == pytest.approx(0.30) and "twice the standard error of the 4 repeats" in text
    agg, split = layout(AGGREGATED, 2, 2.0), layout("1P:1D", 2, 2.3)
    v = verdict([agg, split], repeats={AGGREGATED: agg_runs, "1P:1D": split_runs})
    assert (v.category, v.runs, v.band) == (NO_CLEAR_GAIN, AGGREGATED, pytest.approx(0.30))
    assert "+15%" in v.reasons[-1] and "±30%" in v.reasons[-1]
    # The same 15% lead in every repeat: the spread is 0, the band 10%, and the split wins.
    steady = [1.15] * 4
    assert noise_band(agg_runs, steady)[0] == MARGIN
    v = verdict([agg, split], repeats={AGGREGATED: agg_runs, "1P:1D": steady})
    assert v.category == SPLIT
    # One repeat, or nothing served by either layout: the plain margin.
    assert noise_band([1.0], [2.0]) == (MARGIN, "10%")
    assert noise_band([0.0, 0.0], [0.0, 0.0])[0] == MARGIN


# One replica that prefills 1,000 prompt tokens/s and steps its decodes in 10 ms at any batch.
FLAT = ServiceProfile(
    prefill_tokens_per_s=1000, decode_sequences=1, decode_tpot_s=0.01, kv_bytes_per_token=1000
)


def test_long_prompts_at_one_request_per_replica_stay_aggregated() -> None:
    # 500 prompt tokens (s = 0.5 s), 11 output tokens (10 decode steps); the split moves the 31 whole blocks
    # of 16 before the last token (496 tokens, 4.96e5 KV bytes over 10 MB/s = 49.6 ms) and prefills the
    # other 4 again on the decode replica.
    layouts = predict(FLAT, 500, 11, 1e7, [Ratio(1, 1)], ttft_slo_s=2.0, tpot_slo_s=0.015, levels=(1,))
    agg, split = layouts
    # Aggregated, one request per replica: nothing else prefills during a decode, so no stall:
    # a request takes 0.5 + 0.01 + 10 x 0.01 = 0.61 s, and every one meets both SLOs.
    assert agg.goodput_per_replica == pytest.approx(1 / 0.61)
    assert agg.ttft_p50_s == pytest.approx(0.51) and agg.tpot_p50_s == pytest.approx(0.01)
    assert "prefill 82% of the time" in (agg.limited_by or "") and "0% of requests stalled" in (
        agg.limited_by or ""
    )
    # 1P:1D with two requests in flight: the one prefill replica is the bottleneck at 1 / 0.5 s = 2 req/s,
    # i.e. 1 per replica; the decode replica idles most of the time.
    assert split.goodput_rps == pytest.approx(2.0) and split.goodput_per_replica == pytest.approx(1.0)
    assert split.transfer_bytes == 4.96e5 and split.transfer_s == pytest.approx(0.0496)
    assert "KV transfer 50 ms for 496 of 500 prompt tokens" in (split.limited_by or "")
    assert "prefill pool busy 99%" in (split.limited_by or "")
    v = verdict(layouts)
    assert v.category == AGGREGATED and "39% fewer good requests per replica" in v.reasons[-2]


def test_long_prompts_under_load_split_when_stalls_break_the_tpot_slo() -> None:
    # 500 prompt tokens, 101 output tokens, 4 requests per replica, TPOT SLO 12 ms over 10 ms steps: one
    # 0.5 s prefill spread over 100 tokens adds 5 ms to each, so a request meets the SLO only if no other
    # prompt is prefilled during its decode.
    agg = aggregated_at(FLAT, 500, 101, 4, ttft_slo_s=5.0, tpot_slo_s=0.012)
    # The point solves the closed loop: X = c / (s + wait + t + D), D = 100 t / (1 - u), u = X s (c-1)/c.
    u = agg.requests_per_s * 0.5 * 3 / 4
    decode = 100 * 0.01 / (1 - u)
    wait = u * 0.5 / (2 * (1 - u))
    assert agg.requests_per_s == pytest.approx(4 / (0.5 + wait + 0.01 + decode), rel=1e-6)
    # Stalls per request: Poisson with mean u D / s; the TPOT SLO allows none.
    stalls = u * decode / 0.5
    assert agg.good_share == pytest.approx(math.exp(-stalls), rel=1e-6)
    assert agg.tpot_s == pytest.approx(0.01 + stalls * 0.5 / 100)
    split = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012)
    # The prefill pool's 1 / 0.5 s; on the decode replica only the prompts' 4-token tails (4 ms) land in a
    # decode, 0.04 ms a token each: fifty fit in the SLO.
    assert split.requests_per_s == pytest.approx(2.0) and split.tpot_s == pytest.approx(0.01, abs=2e-4)
    assert split.good_share == pytest.approx(1.0)
    v = verdict(predict(FLAT, 500, 101, 1e7, [Ratio(1, 1)], ttft_slo_s=5.0, tpot_slo_s=0.012, levels=(4,)))
    assert v.category == SPLIT and "decode no longer waits behind prefills" in v.reasons[-1]


def test_short_prompts_stay_aggregated_and_a_flat_step_is_no_clear_gain() -> None:
    # 20 prompt tokens (s = 20 ms), 101 output tokens; the step grows with the batch: 10, 11, 13 ms at 1, 2, 4.
    growing = ServiceProfile(1000, 4, 0.013, 1000, step_s=((1, 0.01), (2, 0.011), (4, 0.013)))
    assert growing.step_at(3) == pytest.approx(0.012) and growing.step_at(6) == pytest.approx(0.015)
    assert growing.step_at(0.5) == 0.01
    layouts = predict(growing, 20, 101, 1e7, [Ratio(1, 1)], ttft_slo_s=0.1, tpot_slo_s=0.015, levels=(1, 2))
    agg, split = layouts
    # A 20 ms stall over 100 tokens adds 0.2 ms: the TPOT SLO (15 ms) allows 10 of them; the stalls cost
    # little. The split puts every decode on one replica (twice the batch, a slower step) and adds a hop.
    assert agg.goodput_per_replica > split.goodput_per_replica
    one = aggregated_at(growing, 20, 101, 1)
    assert one.requests_per_s == pytest.approx(1 / (0.02 + 0.01 + 100 * 0.01))  # alone: no wait, no stall
    v = verdict(layouts)
    assert v.category == AGGREGATED and v.runs == AGGREGATED
    # With a step that does not grow with the batch the two layouts serve within 10%: no clear gain.
    v = verdict(predict(FLAT, 20, 101, 1e7, [Ratio(1, 1)], ttft_slo_s=0.1, tpot_slo_s=0.015, levels=(1, 2)))
    assert v.category == NO_CLEAR_GAIN and v.runs == AGGREGATED
    assert v.reasons[-1].startswith("no clear gain: stay aggregated (simpler)")


def test_pulls_on_the_replicas_own_cores_cost_the_prefill_and_stall_the_decodes() -> None:
    # 500 prompt tokens, 101 output tokens, 4 requests per replica, a 50 ms pull on a 10 ms step and a
    # 12 ms TPOT SLO. Each arrival on the decode replica also prefills the prompt's 4-token tail (4 ms).
    # With the pull on its cores an arrival stalls decodes 54 ms, 0.54 ms a token: three fit in the SLO.
    free = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012)
    cpu = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012, pull_stall=1.0)
    # The closed loop with the decode replica's time taken by pulls and tails: v = X (T + r) / d,
    # D = 100 t / (1 - v).
    x = cpu.requests_per_s
    v = x * 0.054
    decode = 100 * 0.01 / (1 - v)
    stalls = v * decode / 0.054
    assert cpu.tpot_s == pytest.approx(0.01 + stalls * 0.054 / 100, rel=1e-6)
    assert cpu.stalled_share == pytest.approx(1 - math.exp(-stalls), rel=1e-6) and cpu.stalled_share > 0
    assert cpu.good_share == pytest.approx(
        sum(math.exp(-stalls) * stalls**k / math.factorial(k) for k in range(4)), rel=1e-6
    )
    # The one prefill replica caps the pair: 1 / 0.5 s = 2 req/s beside a copy engine, 1 / (0.5 + 0.05) s
    # where serving the pull takes its core too; and the decodes are slower.
    assert free.requests_per_s == pytest.approx(2.0) and x == pytest.approx(1 / 0.55)
    assert cpu.tpot_s > free.tpot_s and cpu.good_share < free.good_share == pytest.approx(1.0)
    # A TPOT SLO of 10.2 ms allows no pull in a decode: the split loses the share that meets one.
    tight = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.0102, pull_stall=1.0)
    assert tight.good_share == pytest.approx(math.exp(-stalls), rel=1e-6)
    layouts = predict(FLAT, 500, 101, 1e7, [Ratio(1, 1)], ttft_slo_s=5.0, tpot_slo_s=0.0102, levels=(4,),
                      pull_stall=pull_stall_for(0))  # fmt: skip
    assert "of decodes stalled by another request's pull" in (layouts[1].limited_by or "")
    assert pull_stall_for(0) == 1.0 and pull_stall_for(1) == 0.0
    with pytest.raises(ValueError, match=r"within \[0, 1\]"):
        predict(FLAT, 500, 101, 1e7, [Ratio(1, 1)], pull_stall=2.0)


def test_the_measured_transfer_cpu_replaces_the_wall_time_on_each_side() -> None:
    # The same split with a 50 ms pull whose measured CPU is 10 ms on the producer and 20 ms on the
    # consumer: the prefill replica spends 0.5 + 0.01 s a request, each arrival stalls decodes 20 ms for
    # its pull and 4 ms for its tail.
    cpu = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012, pull_stall=1.0,
                   transfer_cpu_s=(0.01, 0.02))  # fmt: skip
    x = cpu.requests_per_s
    assert x == pytest.approx(1 / 0.51)  # the prefill replica's cap p / (s + Cp)
    assert cpu.prefill_busy == pytest.approx(min(0.99, x * 0.51))
    v = x * 0.024  # the decode replica's time taken by pulls and tails: X (Cc + r) / d
    decode = 100 * 0.01 / (1 - v)
    stalls = v * decode / 0.024
    assert cpu.tpot_s == pytest.approx(0.01 + stalls * 0.024 / 100, rel=1e-6)
    # (12 - 10) ms × 100 tokens / 24 ms: eight arrivals may land in a decode before it misses the TPOT SLO.
    assert cpu.good_share == pytest.approx(
        sum(math.exp(-stalls) * stalls**k / math.factorial(k) for k in range(9)), rel=1e-6
    )
    wall = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012, pull_stall=1.0)
    free = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012)
    assert free.goodput_rps > cpu.goodput_rps > wall.goodput_rps
    # Beside a copy engine (pull_stall 0) a measured CPU figure charges nothing either.
    gpu = split_at(FLAT, 500, 101, 4, Ratio(1, 1), 0.05, ttft_slo_s=5.0, tpot_slo_s=0.012,
                   transfer_cpu_s=(0.01, 0.02))  # fmt: skip
    assert gpu == free
    # The prediction says which figure it charged.
    said = predict(
        FLAT, 500, 101, 1e7, [Ratio(1, 1)], levels=(4,), pull_stall=1.0, transfer_cpu_s=(0.01, 0.02)
    )
    assert "charged its measured CPU time: 10 ms to the prefill side, 20 ms to the decode side" in (
        said[1].limited_by or ""
    )
    assert (said[1].transfer_cpu_producer_s, said[1].transfer_cpu_consumer_s) == (0.01, 0.02)
    assert "(CPU 10 ms on the prefill side, 20 ms on the decode side)" in verdict(said).reasons[1]
    by_wall = predict(FLAT, 500, 101, 1e7, [Ratio(1, 1)], levels=(4,), pull_stall=1.0)
    assert (
        "charged its wall time 50 ms to each side's compute (the transfer's CPU time was not measured)"
        in (by_wall[1].limited_by or "")
    )
    copy_engine = predict(FLAT, 500, 101, 1e7, [Ratio(1, 1)], levels=(4,))
    assert "not charged to the replicas' compute" in (copy_engine[1].limited_by or "")
    with pytest.raises(ValueError, match="producer's and the consumer's CPU seconds"):
        predict(FLAT, 500, 101, 1e7, [Ratio(1, 1)], pull_stall=1.0, transfer_cpu_s=(-0.01, 0.02))


def test_a_slow_link_or_a_tight_ttft_slo_loses_the_split() -> None:
    # 500 prompt tokens at 1,000 KV bytes each over 1 MB/s: 0.5 s per transfer, past a 0.9 s TTFT SLO.
    layouts = predict(FLAT, 500, 101, 1e6, [Ratio(1, 1)], ttft_slo_s=0.9, tpot_slo_s=0.012, levels=(4,))
    assert layouts[1].goodput_rps == 0 and "within the TTFT SLO" in (layouts[1].limited_by or "")
    with pytest.raises(ValueError, match="positive"):
        predict(FLAT, 500, 101, 0, [Ratio(1, 1)])
    with pytest.raises(ValueError, match="concurrencies"):
        predict(FLAT, 500, 101, 1e6, [Ratio(1, 1)], levels=(0,))


def test_a_profile_from_a_sweep_report() -> None:
    def level(c: int, ttft_ms: float, tpot_ms: float, valid: bool = True) -> dict[str, object]:
        return {"concurrency": c, "valid": valid, "tokens": {"prompt_mean": 500.0},
                "latency_ms": {"ttft": {"p50": ttft_ms}, "tpot": {"p50": tpot_ms}}}  # fmt: skip

    report = {
        "levels": [level(4, 90, 30), level(1, 50, 20), level(8, 200, 45), level(16, 400, 60, valid=False)]
    }
    report["levels"][0]["latency_ms"]["itl"] = {"p50": 25.0}  # type: ignore[index]
    p = profile_from_report(report, kv_bytes_per_token=2048, tpot_slo_s=0.04)
    assert (p.prefill_tokens_per_s, p.decode_sequences, p.decode_tpot_s) == (10_000, 4, 0.03)
    # The decode step at each level: its ITL p50 where measured (the median gap, without the stalls), else TPOT.
    assert p.levels == (1, 4, 8) and p.step_s == ((1, 0.02), (4, 0.025), (8, 0.045))
    assert profile_from_report(report, 2048).decode_sequences == 8
    with pytest.raises(ValueError, match="no level of the report meets the TPOT SLO"):
        profile_from_report(report, 2048, tpot_slo_s=0.01)
    # The server's own prefill rate, when the bench scraped it, is preferred over the end-to-end TTFT.
    report["levels"][1]["server"] = {"load": {"prefill_tokens_per_s": 25_000.0}}
    assert profile_from_report(report, 2048).prefill_tokens_per_s == 25_000
    # With the server's rate the TTFT at one request in flight has room for what the request spent
    # outside the engine's compute: 50 ms less 500 / 25,000 s of prefill and a 20 ms step = 10 ms.
    p = profile_from_report(report, 2048)
    assert p.request_overhead_s == pytest.approx(0.01)
    assert profile_from_report(report, 2048, block_size=32).block_size == 32
    # Read off the TTFT itself (no scraped rate) there is none left to find.
    del report["levels"][1]["server"]
    assert profile_from_report(report, 2048).request_overhead_s == 0


def test_a_split_request_pays_the_request_overhead_twice_and_its_tail_on_the_decode_side() -> None:
    # 32 prompt tokens at 1,000 tokens/s (s = 32 ms), blocks of 16: the split moves the first block (the
    # second holds the last token), and the decode replica prefills the other 16 tokens again (16 ms).
    # 5 ms outside the engine per request. One request in flight: nothing queues or stalls.
    slow = ServiceProfile(1000, 1, 0.01, 1000, request_overhead_s=0.005)
    assert [slow.moved_tokens(n) for n in (1, 16, 17, 32, 33, 500)] == [0, 0, 16, 16, 32, 496]
    agg = aggregated_at(slow, 32, 11, 1)
    assert agg.ttft_s == pytest.approx(0.005 + 0.032 + 0.01)
    assert agg.requests_per_s == pytest.approx(1 / (0.005 + 0.032 + 0.01 + 10 * 0.01))
    split = split_at(slow, 32, 11, 0.5, Ratio(1, 1), 0.002)  # half a request per replica of the pair
    assert split.ttft_s == pytest.approx(2 * 0.005 + 0.032 + 0.002 + 0.016 + 0.01)
    layouts = predict(slow, 32, 11, 1000 * 16 / 0.002, [Ratio(1, 1)], levels=(0.5,))
    assert layouts[1].transfer_bytes == 16_000 and layouts[1].transfer_s == pytest.approx(0.002)
    assert layouts[1].ttft_p50_s == pytest.approx(split.ttft_s)
    assert "KV transfer 2 ms for 16 of 32 prompt tokens (the rest prefilled again on the decode replica)" in (
        layouts[1].limited_by or ""
    )
    # Without the overhead the split's TTFT loses 10 ms and aggregated's 5.
    bare = ServiceProfile(1000, 1, 0.01, 1000)
    assert split_at(bare, 32, 11, 0.5, Ratio(1, 1), 0.002).ttft_s == pytest.approx(split.ttft_s - 0.01)
    assert aggregated_at(bare, 32, 11, 1).ttft_s == pytest.approx(agg.ttft_s - 0.005)


def test_cpu_other_processes_take_from_the_replicas_cores_slows_aggregated_and_spares_an_idle_prefill_pool() -> (
    None
):
    # 20 prompt tokens (20 ms), 11 output tokens (10 steps of 10 ms), one request per replica: 130 ms alone.
    # The load generator and router take 13 ms of CPU per request from the replicas' cores.
    bare = aggregated_at(FLAT, 20, 11, 1)
    assert bare.requests_per_s == pytest.approx(1 / 0.13)
    shared = aggregated_at(FLAT, 20, 11, 1, host_cpu_s=0.013)
    # The replica keeps f = 1 − X·h of its core: X = f / 0.13 → X = 1 / (0.13 + 0.013).
    x = 1 / 0.143
    f = 1 - x * 0.013
    assert shared.requests_per_s == pytest.approx(x, rel=1e-6)
    assert shared.ttft_s == pytest.approx(0.03 / f, rel=1e-6) and shared.tpot_s == pytest.approx(
        0.01 / f, rel=1e-6
    )
    # Split 1P:1D, two in flight: the prefill replica is idle most of the time and takes all of it; the
    # decode replica keeps its core (its steps are the bare split's), the prefill replica's prompts slow.
    alone = split_at(FLAT, 20, 11, 1, Ratio(1, 1), 0.001)
    beside = split_at(FLAT, 20, 11, 1, Ratio(1, 1), 0.001, host_cpu_s=0.013)
    # (its tails stall it a little less: fewer arrivals a second.)
    assert beside.tpot_s <= alone.tpot_s and beside.prefill_busy > alone.prefill_busy
    assert beside.requests_per_s < alone.requests_per_s
    # More than the prefill pool's idle time spills onto the decode replica.
    crowded = split_at(FLAT, 20, 11, 1, Ratio(1, 1), 0.001, host_cpu_s=0.2)
    assert crowded.tpot_s > alone.tpot_s
    # The prediction charges each layout its own figure and says so; none is charged by default.
    layouts = predict(
        FLAT, 20, 11, 1e7, [Ratio(1, 1)], levels=(1,), host_cpu_s={"aggregated": 0.013, "1P:1D": 0.013}
    )
    assert layouts[0].goodput_rps == pytest.approx(shared.goodput_rps)
    assert "other processes taking 13 ms of CPU per request from the replicas' cores" in (
        layouts[0].limited_by or ""
    )
    assert "the prefill replicas' idle time first" in (layouts[1].limited_by or "")
    assert predict(FLAT, 20, 11, 1e7, [Ratio(1, 1)], levels=(1,))[0].goodput_rps == pytest.approx(
        bare.goodput_rps
    )
    with pytest.raises(ValueError, match="CPU seconds per request are zero or more"):
        predict(FLAT, 20, 11, 1e7, [Ratio(1, 1)], host_cpu_s={"aggregated": -1.0})
