"""Prefill/decode disaggregation in two engines of one process, over the real TCP transport.

Shows: a prompt prefilled on a producer and decoded on a consumer gives the aggregated engine's
greedy output; the consumer pulls only the blocks past the prefix it holds, and tells the producer
to let go when it holds them all; a corrupt block on the wire or a producer of another model is
rejected and the rest prefilled locally; an unpulled hold is freed by its timeout (a late pull is
refused); each side records the CPU time its threads spent on a transfer, stage by stage; roles
refuse what they cannot do; a producer's two copy paths (numpy on CPU, the staged
path CUDA uses) read the same bytes; the client's pull keeps its deadline against a silent peer.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plimsoll.runtime.kv.transfer_config import KVTransferConfig
from plimsoll.runtime.kv.transport import TransferError, TransferServer, request_blocks

ENGINE: dict[str, Any] = {"kv_cache_memory": "160KiB", "max_model_len": 256}  # 20 blocks of 16 tokens


def producer_config(**extra: float) -> dict[str, Any]:
    return {"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 0, "kv_connector_extra_config": extra}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def greedy(n: int = 6, **kw: Any) -> Any:
    from plimsoll.runtime import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> Path:
    return Path(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[tuple[Any, Any, Any]]:
    """(aggregated, producer, consumer) engines of one model."""
    from plimsoll.runtime import LLM

    consumer = {"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout": 5}}
    built = [
        LLM(model=str(model), **ENGINE),
        LLM(model=str(model), kv_transfer_config=producer_config(abort_request_timeout=60), **ENGINE),
        LLM(model=str(model), kv_transfer_config=consumer, **ENGINE),
    ]
    yield built[0].engine, built[1].engine, built[2].engine
    for llm in built:
        llm.close()


def prefill(producer: Any, ids: list[int]) -> dict[str, Any]:
    out = producer.generate([ids], greedy(1, kv_transfer_params={"do_remote_decode": True}))[0]
    params = out.kv_transfer_params
    assert params is not None and params["do_remote_prefill"] and params["remote_host"] == "127.0.0.1"
    return dict(params)


def settle(engine: Any) -> None:
    """Free whatever the producer's pulls and timeouts let go of (the async engine does it on wake-up)."""
    deadline = time.monotonic() + 10
    while engine.kv_connector.remote.held_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.apply_kv_releases()


def test_split_matches_aggregated_and_pulls_only_what_is_missing(engines: Any) -> None:
    aggregated, producer, consumer = engines
    remote = consumer.kv_connector.remote
    a = prompt(1, 100)
    b = a[:64] + prompt(2, 60)  # shares four full blocks with a
    for ids in (a, b):
        expected = aggregated.generate([ids], greedy())[0].outputs[0].token_ids
        before = (remote.counters.blocks_received, remote.counters.blocks_skipped)
        params = prefill(producer, ids)
        assert len(params["remote_block_ids"]) == len(ids) // 16
        out = consumer.generate([ids], greedy(kv_transfer_params=params))[0]
        assert out.outputs[0].token_ids == expected
        received = remote.counters.blocks_received - before[0]
        skipped = remote.counters.blocks_skipped - before[1]
        # Full blocks short of the last token: a's 6, of which b's first 4 were already here.
        assert (received, skipped) == ((6, 0) if ids is a else (3, 4))
        assert out.metrics.num_cached_tokens == (len(ids) - 1) // 16 * 16
        settle(producer)
        assert producer.scheduler.kv.usage() == 0.0 and consumer.scheduler.kv.usage() == 0.0


def test_a_transfer_records_the_cpu_time_each_side_spent_on_it(engines: Any) -> None:
    from plimsoll.runtime.kv.remote_prefill import CPU_STAGES

    _, producer, consumer = engines
    sides = {
        "producer": producer.kv_connector.remote.counters,
        "consumer": consumer.kv_connector.remote.counters,
    }
    before = {stage: (sides[side].cpu_seconds[stage], len(sides[side].cpu_samples[stage]))
              for stage, (side, _) in CPU_STAGES.items()}  # fmt: skip
    ids = prompt(11, 120)  # a prompt no other test sends
    params = prefill(producer, ids)
    out = consumer.generate([ids], greedy(kv_transfer_params=params))[0]
    assert out.metrics.num_cached_tokens == 112  # seven blocks pulled and loaded, not recomputed
    settle(producer)
    for stage, (side, _) in CPU_STAGES.items():
        seconds, samples = before[stage]
        # One sample for this request, nonzero: the thread's own CPU clock moved while it did the work.
        assert len(sides[side].cpu_samples[stage]) == samples + 1, stage
        assert sides[side].cpu_seconds[stage] > seconds, stage
    # The producer's side of the transfer is on the producer only, the consumer's on the consumer only.
    assert all(sides["consumer"].cpu_seconds[s] == 0 for s in ("hold", "send"))
    assert all(sides["producer"].cpu_seconds[s] == 0 for s in ("start", "receive", "load"))


def test_a_full_local_hit_pulls_nothing_and_frees_the_producer_at_once(engines: Any) -> None:
    _, producer, consumer = engines
    ids = prompt(3, 90)
    expected = consumer.generate([ids], greedy())[0].outputs[0].token_ids  # the consumer computes it itself
    params = prefill(producer, ids)
    assert producer.kv_connector.remote.held_blocks == 5
    pulls = consumer.kv_connector.remote.counters.pulls
    out = consumer.generate([ids], greedy(kv_transfer_params=params))[0]
    assert out.outputs[0].token_ids == expected
    assert consumer.kv_connector.remote.counters.pulls == pulls
    settle(producer)  # the consumer's release message, not the 60 s timeout
    assert producer.kv_connector.remote.held_blocks == 0 and producer.scheduler.kv.usage() == 0.0


def test_a_corrupt_block_on_the_wire_is_rejected(engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from plimsoll.runtime.kv import remote_prefill

    aggregated, producer, consumer = engines
    ids = prompt(4, 120)
    expected = aggregated.generate([ids], greedy())[0].outputs[0].token_ids
    real_pack = remote_prefill.pack_block

    def flip_a_byte(address: bytes, payload: bytes) -> bytes:
        blob = bytearray(real_pack(address, payload))
        blob[-100] ^= 0x40  # in the payload, after the digest was taken: what a bad link does
        return bytes(blob)

    monkeypatch.setattr(remote_prefill, "pack_block", flip_a_byte)
    params = prefill(producer, ids)
    failures = dict(consumer.kv_connector.remote.counters.failures)
    out = consumer.generate([ids], greedy(kv_transfer_params=params))[0]
    assert out.outputs[0].token_ids == expected  # prefilled locally
    assert (
        consumer.kv_connector.remote.counters.failures.get("rejected", 0) == failures.get("rejected", 0) + 1
    )
    settle(producer)
    assert producer.scheduler.kv.usage() == 0.0 and consumer.scheduler.kv.usage() == 0.0


def test_blocks_of_another_model_are_rejected(engines: Any, tmp_path: Path) -> None:
    from plimsoll.runtime import LLM
    from plimsoll.runtime.testing import write_tiny_model

    aggregated, _, consumer = engines
    other = LLM(model=str(write_tiny_model(tmp_path / "other", seed=7)),
                kv_transfer_config=producer_config(), **ENGINE)  # fmt: skip
    try:
        ids = prompt(5, 80)
        params = prefill(other.engine, ids)
        rejected = consumer.kv_connector.remote.counters.failures.get("rejected", 0)
        out = consumer.generate([ids], greedy(kv_transfer_params=params))[0]
        # The consumer's own model's answer: nothing of the other model's KV was used.
        assert out.outputs[0].token_ids == aggregated.generate([ids], greedy())[0].outputs[0].token_ids
        assert consumer.kv_connector.remote.counters.failures.get("rejected", 0) == rejected + 1
        settle(other.engine)
        assert other.engine.scheduler.kv.usage() == 0.0
    finally:
        other.close()


def test_an_unpulled_hold_expires_and_a_late_pull_is_refused(model: Path, engines: Any) -> None:
    from plimsoll.runtime import LLM

    aggregated, _, consumer = engines
    producer = LLM(
        model=str(model), kv_transfer_config=producer_config(abort_request_timeout=0.3), **ENGINE
    ).engine
    try:
        ids = prompt(6, 70)
        params = prefill(producer, ids)
        assert producer.scheduler.kv.usage() > 0
        settle(producer)  # the server's tick frees it after 0.3 s
        remote = producer.kv_connector.remote
        assert remote.counters.expired == 1 and producer.scheduler.kv.usage() == 0.0
        refused = consumer.kv_connector.remote.counters.failures.get("refused", 0)
        out = consumer.generate([ids], greedy(kv_transfer_params=params))[0]
        assert out.outputs[0].token_ids == aggregated.generate([ids], greedy())[0].outputs[0].token_ids
        assert consumer.kv_connector.remote.counters.failures["refused"] == refused + 1
    finally:
        producer.close()


def test_roles_refuse_what_they_cannot_do(engines: Any) -> None:
    aggregated, producer, consumer = engines
    remote_prefill = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
                      "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": 1}  # fmt: skip
    with pytest.raises(ValueError, match="kv_role is kv_producer"):
        producer.add_request("x", [5, 6, 7], greedy(kv_transfer_params=remote_prefill))
    with pytest.raises(ValueError, match="kv_role is kv_consumer"):
        consumer.add_request("y", [5, 6, 7], greedy(kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="n=1"):
        producer.add_request("z", [5, 6, 7], _two(kv_transfer_params={"do_remote_decode": True}))
    # Without --kv-transfer-config the parameters are ignored (vLLM's rule): the request runs here in full.
    out = aggregated.generate([[5, 6, 7]], greedy(kv_transfer_params={"do_remote_decode": True}))[0]
    assert out.kv_transfer_params is None and len(out.outputs[0].token_ids) == 6
    # Incomplete remote parameters: prefilled locally, counted.
    invalid = consumer.kv_connector.remote.counters.failures.get("invalid", 0)
    out = consumer.generate([[5, 6, 7]], greedy(kv_transfer_params={"do_remote_prefill": True}))[0]
    assert len(out.outputs[0].token_ids) == 6
    assert consumer.kv_connector.remote.counters.failures["invalid"] == invalid + 1


def _two(**kw: Any) -> Any:
    from plimsoll.runtime import SamplingParams

    return SamplingParams(n=2, temperature=0, max_tokens=2, **kw)


def test_the_staged_copy_path_reads_the_same_bytes(engines: Any) -> None:
    from plimsoll.runtime.kv.remote_prefill import _Staging
    from plimsoll.runtime.kv.transfer import export_blocks, payload_of

    _, producer, _ = engines
    kv_caches = producer.runner.kv_caches
    ids = [0, 3, 19, 7] * 5  # more than one staging buffer's worth
    direct = list(_Staging(kv_caches).payloads(ids))
    staged = list(_Staging(kv_caches, blocks=3, staged=True).payloads(ids))
    exported = export_blocks(kv_caches, ids)
    assert direct == staged == [payload_of(exported[i]) for i in range(len(ids))]


def test_config_refuses_other_connectors_and_their_fields() -> None:
    from plimsoll.runtime.engine.config import EngineConfig

    with pytest.raises(
        ValueError, match="'NixlConnector' is not available in plimsoll; leave kv_connector out"
    ):
        KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}')
    with pytest.raises(ValueError, match="kv_buffer_size configure vLLM's other connectors"):
        KVTransferConfig.parse({"kv_role": "kv_both", "kv_buffer_size": 1e9})
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVTransferConfig.parse("kv_both")
    assert KVTransferConfig.parse('{"kv_connector": "PlimsollConnector"}').kv_role == "kv_both"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="drop --no-enable-prefix-caching"):
        EngineConfig(kv_transfer_config={"kv_role": "kv_both"}, enable_prefix_caching=False)


def test_serve_refuses_an_unknown_connector_at_start(model: Path) -> None:
    from typer.testing import CliRunner

    from plimsoll.cli import app

    args = [
        "serve",
        "--model",
        str(model),
        "--port",
        "1",
        "--kv-transfer-config",
        '{"kv_connector": "NixlConnector"}',
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "'NixlConnector' is not available in plimsoll" in result.output


def test_a_pull_keeps_its_deadline_against_a_silent_or_absent_peer() -> None:
    from plimsoll.runtime.testing import free_port

    with pytest.raises(TransferError) as absent:
        request_blocks("127.0.0.1", free_port(), {"op": "pull"}, timeout_s=2.0)
    assert absent.value.reason == "connect"
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the kernel's backlog), never answers
        t0 = time.monotonic()
        with pytest.raises(TransferError) as late:
            request_blocks("127.0.0.1", silent.getsockname()[1], {"op": "pull"}, timeout_s=0.3)
        assert late.value.reason == "timeout" and time.monotonic() - t0 < 5
    # A handler that fails answers that one pull with ok: false, and the server goes on.
    server = TransferServer("127.0.0.1", 0, lambda message: 1 / 0).start()  # type: ignore[arg-type,return-value]
    try:
        for _ in range(2):
            with pytest.raises(TransferError) as refused:
                request_blocks("127.0.0.1", server.port, {"op": "pull"}, timeout_s=5.0)
            assert refused.value.reason == "refused" and "ZeroDivisionError" in str(refused.value)
    finally:
        server.close()
