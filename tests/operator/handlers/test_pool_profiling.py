"""What each pool's profile report gives its scaling (pure): prefill prompt tokens/s, decode sequences and TPOT."""

from plimsoll.operator.handlers.pool_profiling import describe, pool_figures
from plimsoll.operator.scaling.profile import CapacityProfile, LevelPoint


def profile(recommended: int) -> CapacityProfile:
    levels = (
        LevelPoint(1, ttft_p95_ms=60, tpot_p50_ms=10, e2e_mean_ms=100, output_tokens_per_s=10.0),
        LevelPoint(4, ttft_p95_ms=150, tpot_p50_ms=20, e2e_mean_ms=300, output_tokens_per_s=32.0),
        LevelPoint(8, ttft_p95_ms=900, tpot_p50_ms=45, e2e_mean_ms=900, output_tokens_per_s=40.0),
    )
    return CapacityProfile(schema_version="1", throughput_knee=8, latency_knee=4,
                           concurrency_per_replica=recommended, workload=None, levels=levels)  # fmt: skip


def test_the_prefill_figure_is_prompt_tokens_per_second_at_the_recommended_level() -> None:
    # One output token per request: 32 tokens/s at c=4 is 32 requests/s of 512 prompt tokens.
    figures = pool_figures("prefill", profile(5), input_tokens=512, output_tokens=1)
    assert figures["promptTokensPerSecond"] == 32 * 512 and figures["atConcurrency"] == 4
    assert "sequencesPerReplica" not in figures
    assert describe("prefill", figures) == "16,384 prompt tokens/s at the TTFT SLO (c=4)"


def test_the_decode_figure_is_sequences_and_their_tpot() -> None:
    figures = pool_figures("decode", profile(4), input_tokens=64, output_tokens=128)
    assert (figures["sequencesPerReplica"], figures["tpotSeconds"]) == (4, 0.02)
    assert describe("decode", figures) == "4 sequences per replica at the TPOT SLO (TPOT 20 ms)"


def test_a_report_without_throughput_gives_no_figure() -> None:
    bare = CapacityProfile(schema_version="1", throughput_knee=None, latency_knee=None,
                           concurrency_per_replica=2, workload=None)  # fmt: skip
    figures = pool_figures("prefill", bare, input_tokens=512, output_tokens=1)
    assert "promptTokensPerSecond" not in figures and describe("prefill", figures) == "no rate"
