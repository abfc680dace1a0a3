"""`plimsoll bench disagg` against two real servers that can take either role (``kv_both``).

Shows: both layouts run through the real router (aggregated on both, 1P:1D split), the report
carries goodput per replica, latency percentiles and, for the split, the KV transfer per request in
bytes (the prompt's full blocks × this model's KV bytes per block), milliseconds, and the CPU time
each side spent on it (scraped from both replicas' ``plimsoll_kv_transfer_cpu_seconds``); the verdict is
the layout with the higher goodput per replica only beyond the noise band, with its reasons; a
replica that cannot take either role is refused before any load, saying how to start it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plimsoll.cli import app
from plimsoll.disaggregation import MARGIN
from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

pytestmark = pytest.mark.slow
ENGINE = {"max_model_len": 256, "kv_cache_memory": "1MiB", "max_num_seqs": 8}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ThreadedServer]]:
    # Served under its path: the bench then reads its tokenizer from there (exact prompt lengths).
    model = write_tiny_model(tmp_path_factory.mktemp("bench-disagg") / "tiny")
    both = {"kv_role": "kv_both", "kv_ip": "127.0.0.1", "kv_port": 0}
    servers = [ThreadedServer(model, kv_transfer_config=both, **ENGINE).start() for _ in range(2)]
    plain = ThreadedServer(model, **ENGINE).start()
    yield [*servers, plain]
    for s in (*servers, plain):
        s.stop()


def test_aggregated_and_split_measured_with_a_verdict(replicas: list[ThreadedServer], tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    args = ["bench", "disagg", "--url", replicas[0].url, "--url", replicas[1].url, "--ratios", "1:1",
            "--input-tokens", "100", "--output-tokens", "8", "--levels", "1", "--requests-per-level", "8", "--repeats", "2",
            "--slo-ttft-p95-ms", "5000", "--slo-tpot-p50-ms", "1000", "--max-client-lag-ms", "1000",
            "--min-concurrency-ratio", "0.5", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    agg, split = report["verdict"]["layouts"]
    assert (agg["layout"], agg["replicas"], split["layout"], split["replicas"]) == (
        "aggregated",
        2,
        "1P:1D",
        2,
    )
    assert agg["goodput_per_replica_rps"] > 0 and split["goodput_per_replica_rps"] > 0
    assert agg["ttft_p95_s"] and split["tpot_p50_s"] and agg["transfer_bytes"] is None
    # About 100 prompt tokens: 6 full blocks of 16 tokens, each of this model's KV bytes per block.
    block_bytes = replicas[0].engine.engine.kv_connector.remote.host.block_nbytes
    assert split["transfer_bytes"] == pytest.approx(6 * block_bytes, rel=0.2) and split["transfer_s"] > 0
    # The transfer's CPU time per request: the prefill replica's (hold, send), the decode replica's
    # (start, receive, load), each stage seen in every split repeat.
    assert split["transfer_cpu_producer_s"] > 0 and split["transfer_cpu_consumer_s"] > 0
    assert agg["transfer_cpu_producer_s"] is None
    for d in report["layouts"]:
        stages = d["transfer_cpu_s_per_request"]
        expected_stages = {"producer:hold:engine", "producer:send:transfer", "consumer:start:engine",
                           "consumer:receive:transfer", "consumer:load:engine"}  # fmt: skip
        assert (
            (set(stages) == expected_stages and min(stages.values()) > 0)
            if d["layout"] == "1P:1D"
            else not stages
        )
    assert "KV CPU ms/req P/D" in result.output
    # Each layout's replicas' process CPU per request (here both servers share this process: only its presence
    # is checked), by role.
    assert agg["replica_cpu_s"] > 0 and split["replica_cpu_s"] > 0
    assert agg["bench_cpu_s"] > 0 and split["bench_cpu_s"] > 0  # the client and the router it runs
    assert {tuple(sorted(d["replica_cpu_s_per_request"])) for d in report["layouts"]} == {
        ("decode",),
        ("decode", "prefill"),
    }
    # Two repeats, the second in reverse order; each layout's figures are the mean of its two.
    assert [(d["layout"], d["repeat"]) for d in report["layouts"]] == [
        ("aggregated", 1), ("1P:1D", 1), ("1P:1D", 2), ("aggregated", 2)
    ]  # fmt: skip
    assert all(d["split_requests"] >= 8 for d in report["layouts"] if d["layout"] == "1P:1D")
    assert agg["notes"][0].startswith("mean of 2 repeats; good req/s per replica in each: ")
    certainty = report["verdict"]["reasons"][-1]
    assert certainty.startswith(
        f"repeat by repeat, {'1P:1D' if report['verdict']['ratio'] else 'aggregated'} is ahead"
    )
    # The verdict follows the measurement: a layout wins only beyond the noise band (at least MARGIN).
    v = report["verdict"]
    assert v["band"] >= MARGIN
    gain = split["goodput_per_replica_rps"] / agg["goodput_per_replica_rps"] - 1
    category = "split" if gain > v["band"] else "aggregated" if gain < -v["band"] else "no clear gain"
    expected = "1P:1D" if category == "split" else None
    assert (v["category"], v["ratio"]) == (category, expected)
    assert f"verdict: run {expected or 'aggregated'} ({category}, noise band" in result.output
    assert "KV transfer" in result.output and "good req/s per replica" in result.output


def test_a_replica_without_both_roles_is_refused(replicas: list[ThreadedServer]) -> None:
    args = ["bench", "disagg", "--url", replicas[0].url, "--url", replicas[2].url, "--slo-ttft-p95-ms", "500",
            "--slo-tpot-p50-ms", "50"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "cannot prefill for another replica" in result.output and "kv_both" in result.output
    result = CliRunner().invoke(app, ["bench", "disagg", "--url", replicas[0].url, "--ratios", "1:1"])
    assert result.exit_code == 2 and "--slo-ttft-p95-ms and --slo-tpot-p50-ms" in result.output
