"""`bench spec-ab`: the same workload against a server with and without a speculative config.

Two real `plimsoll serve` stacks on a tiny random model (one with n-gram speculation)
and short alternating windows: the report carries both arms, the gains, the acceptance
rate from the candidate's own counters, and a recommendation that follows the 30 % rule.
How fast either arm is on this CPU decides nothing asserted here.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plimsoll.bench.spec_ab import KEEP_ABOVE, decide
from plimsoll.cli import app
from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
ENGINE = dict(max_model_len=256, kv_cache_memory="4MiB", max_num_seqs=8)


@pytest.mark.slow
def test_spec_ab_reports_gain_acceptance_and_a_decision(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "ab.json"
    with (
        ThreadedServer(model, **ENGINE) as base,
        ThreadedServer(model, speculative_config=NGRAM, **ENGINE) as spec,
    ):
        result = CliRunner().invoke(
            app,
            ["bench", "spec-ab", "--url", base.url, "--speculative-url", spec.url, "-c", "2", "--duration", "2",
             "--window", "1", "--input-tokens", "16", "--output-tokens", "16", "--max-client-lag-ms", "1000",
             "--max-error-rate", "0.2", "--min-concurrency-ratio", "0.5", "-o", str(out)],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    ab = report["scenario"]
    assert report["kind"] == "spec_ab" and ab["windows_per_arm"] == 2
    assert [lv["arm"] for lv in report["levels"]] == ["baseline", "speculative"] * 2
    assert ab["draft_tokens"] > 0 and 0 <= ab["acceptance_rate"] <= 1
    assert ab["accepted_tokens"] == pytest.approx(ab["acceptance_rate"] * ab["draft_tokens"])
    speed = ab["gain"]["tpot_p50"]
    assert ab["recommendation"] == ("keep" if speed > KEEP_ABOVE else "drop")
    assert f"speculative config: {ab['recommendation'].upper()}" in result.output
    assert "acceptance rate" in result.output


def _arm(tpot: float, errors: float = 0.0) -> dict[str, float]:
    return {
        "tpot_p50_ms": tpot,
        "e2e_p50_ms": tpot * 20,
        "output_tokens_per_s": 1000 / tpot,
        "error_rate": errors,
    }


def test_the_thirty_percent_rule() -> None:
    assert decide(_arm(30), _arm(20))[0] == "keep"  # 50 % faster
    assert decide(_arm(30), _arm(25))[0] == "drop"  # 20 % faster: not worth it
    verdict, why, _ = decide(_arm(30), _arm(10, errors=0.05))
    assert verdict == "drop" and "failed more requests" in why
    assert decide(_arm(30), {**_arm(20), "tpot_p50_ms": None})[0] == "inconclusive"
