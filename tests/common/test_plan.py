"""`plimsoll plan` through the real CLI, its figures recomputed here from the model's published dimensions."""

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plimsoll.cli import app
from plimsoll.plan import parse_bytes

ROOT = Path(__file__).resolve().parents[2]
MISTRAL = ROOT / "examples" / "model-configs" / "mistral-7b.json"
QWEN = ROOT / "examples" / "model-configs" / "qwen2.5-7b.json"
runner = CliRunner()


def run_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["steps"]  # a warning may go to stderr
    return {s["name"]: s["value"] for s in steps}


def mistral_params() -> int:
    # Tensor by tensor, as in the checkpoint: 32 layers of q/k/v/o, gate/up/down and two norms.
    hidden, inter, layers, vocab, kv_dim = 4096, 14336, 32, 32000, 8 * 128
    per_layer = {
        "q_proj": hidden * hidden,
        "k_proj": hidden * kv_dim,
        "v_proj": hidden * kv_dim,
        "o_proj": hidden * hidden,
        "gate_proj": hidden * inter,
        "up_proj": hidden * inter,
        "down_proj": inter * hidden,
        "input_layernorm": hidden,
        "post_attention_layernorm": hidden,
    }
    return layers * sum(per_layer.values()) + vocab * hidden + vocab * hidden + hidden


def activations(
    hidden: int, inter: int, q_dim: int, kv_dim: int, vocab: int, tokens: int = 2048, rows: int = 64
) -> int:
    """The engine's activation estimate (kv_memory.activation_bytes_estimate), bf16, written out:
    one layer of a full step, then the sampler's 8 float32 copies and a penalty table per row."""
    return tokens * (2 * hidden + q_dim + 2 * kv_dim + q_dim + 3 * inter) * 2 + rows * vocab * (4 * 8 + 5)


def kv_tokens(usable: float, weights: int, acts: int, per_token: int, block: int = 16) -> int:
    budget = int(usable) - weights - acts - 256 * 2**20  # less what CUDA libraries hold outside torch
    return budget // (per_token * block) * block  # whole blocks


def test_7b_gqa_on_an_80gb_gpu() -> None:
    plan = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--context-length", "4096")
    params = mistral_params()
    assert 7.2e9 < params < 7.3e9  # Mistral 7B's published size
    assert plan["parameters"] == params
    weights = params * 2
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head dim 128, bf16
    assert kv_per_token == 128 * 1024
    assert plan["KV bytes per token"] == kv_per_token
    acts = activations(4096, 14336, 4096, 1024, 32000)
    assert plan["activations"] == acts
    tokens = kv_tokens(80 * 2**30 * 0.9, weights, acts, kv_per_token)
    assert plan["KV tokens that fit"] == tokens
    assert plan["sequences at full context"] == tokens // 4096
    assert plan["sequences at full context"] == 115


def test_qwen_bias_and_gqa_and_dtype() -> None:
    plan = run_json("--model-config", str(QWEN), "--gpu-memory", "80GB", "--kv-dtype", "fp8")
    assert 7.6e9 < plan["parameters"] < 7.7e9  # Qwen2.5-7B's published 7.61 B
    assert plan["KV bytes per token"] == 2 * 28 * 4 * 128 * 1


def test_mha_config_needs_four_times_the_kv(tmp_path: Path) -> None:
    cfg = json.loads(MISTRAL.read_text())
    del cfg["num_key_value_heads"]
    mha = tmp_path / "config.json"
    mha.write_text(json.dumps(cfg))
    gqa = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB")
    full = run_json("--model-config", str(tmp_path), "--gpu-memory", "80GiB")  # a model directory works too
    assert full["KV bytes per token"] == 4 * gqa["KV bytes per token"]


def test_report_and_target_give_replicas_and_gpus(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({
        "schema_version": 1,
        "knees": {"throughput": {"concurrency": 32}, "latency": {"concurrency": 16}},
        "recommendation": {"concurrency_per_replica": 12},
    }))  # fmt: skip
    plan = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--report", str(report),
                    "--target-concurrency", "100", "--gpus-per-replica", "2")  # fmt: skip
    assert plan["per-replica concurrency"] == 12
    assert plan["replicas"] == math.ceil(100 / 12) == 9
    assert plan["GPUs"] == 18
    plan = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--report", str(report),
                    "--target-rps", "20", "--latency-s", "3")  # fmt: skip
    assert plan["target in flight"] == 60
    assert plan["replicas"] == 5


def test_table_output_shows_the_arithmetic() -> None:
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "80GiB"],
                           env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 × 32 layers × 8 KV heads × 128 head dim × 2 B (bf16) = 131,072 B" in result.output
    assert "floor(474,768 / 4,096 tokens) = 115 per replica" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-memory", "lots"], "write e.g. 80GiB"),
        (["--gpu-memory", "8GiB"], "do not fit"),
        (["--gpu-memory", "80GiB", "--dtype", "fp12"], "unknown dtype"),
        (["--gpu-memory", "80GiB", "--target-rps", "3"], "--latency-s"),
        (["--gpu-memory", "80GiB", "--context-length", "100000"], "max_position_embeddings"),
        (["--gpu-memory", "80GiB", "--memory-fraction", "1.5"], "memory-fraction"),
    ],
)
def test_bad_input_exits_2_with_a_reason(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_files_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"hidden_size": 10}))
    result = runner.invoke(app, ["plan", "--model-config", str(bad), "--gpu-memory", "80GiB"])
    assert result.exit_code == 2 and "num_attention_heads" in result.output
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"schema_version": 1, "knees": {"throughput": {}}, "recommendation": {}}))
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "80GiB",
                                 "--report", str(report), "--target-concurrency", "10"])  # fmt: skip
    assert result.exit_code == 2 and "no per-replica concurrency" in result.output


def test_parse_bytes_units() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("24Gi") == 24 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20


def sweep(tmp_path: Path) -> Path:
    """A report with measured levels: (concurrency, TTFT p95 ms, E2E mean ms)."""
    levels = [
        {"concurrency": c, "valid": True,
         "latency_ms": {"ttft": {"mean": t, "p50": t, "p95": t}, "tpot": {"mean": 20, "p50": 20, "p95": 25},
                        "e2e": {"mean": e, "p50": e, "p95": e}}}
        for c, t, e in ((1, 40, 1000), (8, 120, 2000), (16, 400, 3000), (32, 1500, 6000))
    ]  # fmt: skip
    report = tmp_path / "sweep.json"
    report.write_text(json.dumps({
        "schema_version": "1.0", "levels": levels,
        "knees": {"throughput": {"concurrency": 16}, "latency": {"concurrency": None}},
        "recommendation": {"concurrency_per_replica": 12, "headroom": 0.75},
    }))  # fmt: skip
    return report


def test_rate_uses_the_reports_latency_at_the_operating_point(tmp_path: Path) -> None:
    plan = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--report", str(sweep(tmp_path)),
                    "--target-rps", "10")  # fmt: skip
    # Mean E2E at 12 in flight: between 2 s (8) and 3 s (16) → 2.5 s; L = 10 × 2.5 = 25.
    assert plan["target in flight"] == 25
    assert plan["replicas"] == math.ceil(25 / 12) == 3


def test_slo_rederives_the_per_replica_target(tmp_path: Path) -> None:
    report = str(sweep(tmp_path))
    plan = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--report", report,
                    "--ttft-p95-ms", "150", "--target-concurrency", "100")  # fmt: skip
    # TTFT p95 ≤ 150 ms up to 8 in flight: ⌊0.75 × 8⌋ = 6 per replica.
    assert plan["per-replica concurrency"] == 6
    assert plan["replicas"] == math.ceil(100 / 6) == 17
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "80GiB",
                                 "--report", report, "--ttft-p95-ms", "5", "--target-concurrency", "10"])  # fmt: skip
    assert result.exit_code == 2 and "no measured level meets the SLO" in result.output


@pytest.mark.slow
def test_a_real_bench_sweep_report_feeds_plan(tmp_path: Path) -> None:
    """The contract end to end: `plimsoll bench sweep` against the simulator writes the report plan reads."""
    from plimsoll.bench.simulator import ServiceCurve, running_simulator
    from plimsoll.operator.scaling.profile import CapacityProfile, read_profile

    out = tmp_path / "sweep.json"
    with running_simulator(ServiceCurve(batch_cap=8, step_t0_s=0.01)) as url:
        result = runner.invoke(app, [
            "bench", "sweep", "--url", url, "--model", "sim-model", "--levels", "1,4,16,32",
            "--input-tokens", "16", "--output-tokens", "4", "--duration-per-level", "1",
            "--max-client-lag-ms", "1000", "--min-concurrency-ratio", "0.8", "--output", str(out),
        ])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    profile = read_profile(report)
    assert isinstance(profile, CapacityProfile), profile
    assert profile.concurrency_per_replica == report["recommendation"]["concurrency_per_replica"]
    assert profile.throughput_knee == report["knees"]["throughput"]["concurrency"]
    assert [lv.concurrency for lv in profile.levels] == [
        lv["concurrency"] for lv in report["levels"] if lv["valid"]
    ]
    plan = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--report", str(out),
                    "--target-concurrency", "100")  # fmt: skip
    assert plan["replicas"] == math.ceil(100 / profile.concurrency_per_replica)


def test_table_output_says_how_an_llmservice_asks_for_the_gpus() -> None:
    one = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "80GiB"])
    assert "LLMService: resources.gpu.count: 1 (one GPU per replica" in one.output
    four = runner.invoke(
        app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "24GiB", "--gpus-per-replica", "4"],
        env={"COLUMNS": "250"},
    )  # fmt: skip
    assert four.exit_code == 0, four.output
    assert "resources.gpu.count: 4" in four.output and "--tensor-parallel-size 4" in four.output


def test_tensor_parallel_figures_are_per_gpu() -> None:
    """-tp 2 on Mistral 7B: each GPU holds half the heads, MLP columns and vocabulary, half the KV heads."""
    one = run_json("--model-config", str(MISTRAL), "--gpu-memory", "24GiB")
    two = run_json("--model-config", str(MISTRAL), "--gpu-memory", "24GiB", "--tensor-parallel-size", "2")
    hidden, inter, layers, vocab, q_out, kv_dim = 4096, 14336, 32, 32000, 4096, 8 * 128
    per_gpu = layers * (
        hidden * q_out // 2 * 2 + 2 * hidden * kv_dim // 2 + 3 * hidden * inter // 2 + 2 * hidden
    )
    per_gpu += 2 * (vocab // 2) * hidden + hidden
    assert two["weight bytes"] == per_gpu * 2  # bf16
    assert two["KV bytes per token"] == one["KV bytes per token"] / 2 == 2 * 32 * 4 * 128 * 2
    acts = activations(4096, 14336 // 2, 4096 // 2, 1024 // 2, 32000)
    assert two["KV tokens that fit"] == kv_tokens(24 * 2**30 * 0.9, per_gpu * 2, acts, 2 * 32 * 4 * 128 * 2)
    assert two["tensor parallel"] == 2
    assert one["GPUs needed"] == two["GPUs needed"] == 1  # 13.5 GiB of bf16 weights fit one 24 GiB GPU


def test_gpus_needed_and_the_fix_when_the_weights_do_not_fit() -> None:
    # 13.5 GiB of weights on 10 GiB GPUs: two GPUs hold 6.7 GiB each, leaving 1.8 GiB after activations
    # and CUDA's own, room for 4,096 tokens of 64 KiB; the error names that split.
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "10GiB"])
    assert result.exit_code == 2
    assert "do not fit" in result.output and "--gpus-per-replica 2" in result.output
    fits = run_json("--model-config", str(MISTRAL), "--gpu-memory", "10GiB", "-tp", "2")
    assert fits["GPUs needed"] == 2 and fits["KV tokens that fit"] > 4096


def test_kv_heads_fewer_than_gpus_are_replicated_and_bad_splits_refused() -> None:
    sixteen = run_json("--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "-tp", "16")
    assert sixteen["KV bytes per token"] == 2 * 32 * 1 * 128 * 2  # 8 KV heads on 16 GPUs: one copy each
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "-tp", "3"])
    assert result.exit_code == 2 and "does not divide the model's 32 attention heads" in result.output


def test_link_bandwidth_predicts_a_prefill_decode_split(tmp_path: Path) -> None:
    """Mistral 7B (128 KiB of KV per token) from the sweep above, measured with 2000-token prompts: one alone
    takes TTFT 40 ms."""
    report = sweep(tmp_path)
    data = json.loads(report.read_text())
    for level in data["levels"]:
        level["tokens"] = {"prompt_mean": 2000.0, "output_mean": 200.0}
    report.write_text(json.dumps(data))
    args = ["--model-config", str(MISTRAL), "--gpu-memory", "80GiB", "--report", str(report),
            "--tpot-p50-ms", "25", "--ttft-p95-ms", "2000"]  # fmt: skip
    fast = runner.invoke(
        app, ["plan", *args, "--link-bandwidth", "50GB/s", "--pd-ratios", "1:1,1:2,1:3", "--json"]
    )
    assert fast.exit_code == 0, fast.output
    split = json.loads(fast.stdout)["disaggregation"]
    # Prefill 2000 tokens / 40 ms = 50,000 tokens/s, a 20 ms step at every level. Aggregated, at its best level
    # (16 per replica) every request's 199 decode steps see other prompts' 40 ms prefills (about 15 of them, each
    # 0.2 ms per token; the 25 ms TPOT SLO allows 24). The split pays: its decodes never stall and one prefill
    # replica feeds a decode replica's 20 ms steps.
    agg = split["layouts"][0]
    assert (
        agg["limited_by"].startswith("c=16 per replica") and "100% of requests stalled" in agg["limited_by"]
    )
    assert (split["choice"], split["ratio"], split["category"]) == ("split", "1P:1D", "split")
    assert split["layouts"][1]["goodput_per_replica_rps"] > 2 * agg["goodput_per_replica_rps"]
    # The whole blocks before the last token move (124 of 16: 1,984 tokens), the other 16 are prefilled again.
    assert split["layouts"][3]["transfer_bytes"] == 1984 * 128 * 1024
    assert "50,000 tokens/s, 32 sequences at TPOT 20 ms" in split["reasons"][0]
    # Over a 1 Gbit/s link the 262 MB of each prompt take 2.1 s: past the TTFT SLO, no split serves anything.
    slow = runner.invoke(app, ["plan", *args, "--link-bandwidth", "1Gbit/s"])
    assert slow.exit_code == 0, slow.output
    assert "prefill/decode split (predicted at the profiled concurrencies): run aggregated" in slow.output
    result = runner.invoke(app, ["plan", "--model-config", str(MISTRAL), "--gpu-memory", "80GiB",
                                 "--link-bandwidth", "50GB/s"])  # fmt: skip
    assert result.exit_code == 2 and "give --report" in result.output
    # The plan says which figure it charged for the transfer: nothing on GPUs; a measured CPU time when given.
    assert (
        "not charged to the replicas' compute (a GPU's copy engine moves the blocks)" in split["reasons"][0]
    )
    cpu = runner.invoke(app, ["plan", *args, "--link-bandwidth", "50GB/s", "--pd-ratios", "1:1",
                              "--pd-transfer-cpu-ms", "30,60", "--json"])  # fmt: skip
    assert cpu.exit_code == 0, cpu.output
    charged = json.loads(cpu.stdout)["disaggregation"]
    assert "measured CPU time (30 ms prefill side, 60 ms decode side)" in charged["reasons"][0]
    assert (
        "charged its measured CPU time: 30 ms to the prefill side, 60 ms to the decode side"
        in (charged["layouts"][1]["limited_by"])
    )
    # 30 ms more per prompt on the one prefill replica (40 ms each): the split serves less than beside a copy engine.
    assert charged["layouts"][1]["goodput_per_replica_rps"] < split["layouts"][1]["goodput_per_replica_rps"]
    for bad, says in (("30", "write PRODUCER,CONSUMER"), ("30,-1", "zero or more")):
        result = runner.invoke(
            app, ["plan", *args, "--link-bandwidth", "50GB/s", "--pd-transfer-cpu-ms", bad]
        )
        assert result.exit_code == 2 and says in result.output
    result = runner.invoke(app, ["plan", *args, "--pd-transfer-cpu-ms", "30,60"])
    assert result.exit_code == 2 and "give --link-bandwidth too" in result.output
