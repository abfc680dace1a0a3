"""Config parsing, prompt building and arrival schedules: pure, fast."""

import itertools
import random
import statistics

import pytest

from plimsoll.bench.config import BenchConfig, BenchInputError, LengthSpec, parse_levels
from plimsoll.bench.loadgen import arrival_offsets
from plimsoll.bench.workload import TokenFit, Workload


@pytest.mark.parametrize(
    ("text", "kind"),
    [("128", "fixed"), ("uniform:8:16", "uniform"), ("normal:64:8", "normal"), ("choice:4,9", "choice")],
)
def test_length_specs_parse_and_sample_in_range(text: str, kind: str) -> None:
    spec = LengthSpec.parse(text)
    assert spec.kind == kind and spec.describe() == text
    rng = random.Random(0)
    values = [spec.sample(rng) for _ in range(200)]
    assert min(values) >= 1 and max(values) <= spec.upper()


@pytest.mark.parametrize("text", ["0", "uniform:9:3", "choice:", "gauss:1:2", "many"])
def test_bad_length_specs_say_how_to_write_them(text: str) -> None:
    with pytest.raises(BenchInputError, match="uniform:LOW:HIGH"):
        LengthSpec.parse(text)


def test_levels_and_config_validation() -> None:
    assert parse_levels("8,1,2") == (8, 1, 2)
    assert BenchConfig(url="http://h:1/", levels=(8, 1, 2, 2)).levels == (1, 2, 8)
    with pytest.raises(ValueError, match="http"):
        BenchConfig(url="h:1")
    with pytest.raises(ValueError, match="shared-prefix-tokens"):
        BenchConfig(url="http://h", shared_prefix_fraction=0.5)


def test_word_prompts_follow_the_calibrated_fit_and_share_prefixes() -> None:
    cfg = BenchConfig(
        url="http://h", input_tokens=LengthSpec(value=41), shared_prefix_tokens=21, shared_prefix_fraction=1.0
    )
    fit = TokenFit(offset=1.0, per_word=2.0)  # e.g. a BOS token and two tokens per word
    w = Workload(cfg, fit)
    a, b = w.next(), w.next()
    assert len(a.prompt.split()) == 20 and a.shared_prefix  # (41 - 1) / 2 words
    assert a.prompt.split()[:10] == b.prompt.split()[:10]  # the 10-word shared prefix
    assert a.prompt != b.prompt  # the rest differs, so no accidental prefix-cache hits


def test_arrival_schedules_keep_the_mean_rate() -> None:
    const = arrival_offsets(10, 5, "constant")
    assert len(const) == 50 and statistics.pstdev([b - a for a, b in itertools.pairwise(const)]) < 1e-9
    poisson = arrival_offsets(20, 100, "poisson", seed=1)
    bursty = arrival_offsets(20, 100, "bursty", burstiness=0.25, seed=1)
    assert len(poisson) == pytest.approx(2000, rel=0.1) and len(bursty) == pytest.approx(2000, rel=0.15)

    def cv(xs: list[float]) -> float:
        gaps = [b - a for a, b in itertools.pairwise(xs)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert cv(poisson) == pytest.approx(1.0, abs=0.15)  # exponential gaps
    assert cv(bursty) > 1.5  # gamma shape 0.25: CV = 2
