"""How a real `plimsoll serve` process ends: engine failure exits 1, a drain deadline exits 0 cleanly.

Each test runs the real command line in its own process; faults and slow steps are
patched into the real engine classes by ``ServerProcess(prelude=...)`` before the CLI
starts. Steps sleep 50 ms each, so "a stream is still running" holds on any CPU.

- An engine-fatal fault (the model runner raises, as a device error would) while two
  streams are in flight: both streams end with an error event and ``[DONE]`` (no hang),
  and the process exits non-zero on its own, so the kubelet restarts it.
- SIGTERM with streams that cannot finish inside ``--drain-timeout``: they end with an
  error event and ``[DONE]`` at the deadline, the process exits 0, and its log holds no
  traceback.
- A CPU server loads no GPU-only module (no Triton in its memory map), and a stop by SIGTERM
  or Ctrl-C (SIGINT) prints nothing after its last log line (no extension's leak report).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import chat_model_dir  # noqa: F401  (fixture)

from plimsoll.runtime.testing import ServerProcess

SLOW_STEPS = """
import time
from plimsoll.runtime.engine.llm_engine import LLMEngine
_step = LLMEngine.step
def _slow_step(self):
    time.sleep(0.05)
    return _step(self)
LLMEngine.step = _slow_step
"""

# The runner fails (as a device error would) once a request seeded FATAL_SEED is in the batch.
FATAL_SEED = 4242
FATAL_FAULT = f"""
from plimsoll.runtime.engine.model_runner import ModelRunner
_execute = ModelRunner.execute
def _execute_or_die(self, sched, *args, **kwargs):
    if any(r.params.seed == {FATAL_SEED} for r, _ in sched.scheduled):
        raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")
    return _execute(self, sched, *args, **kwargs)
ModelRunner.execute = _execute_or_die
"""


def args(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--max-model-len", "256", "--kv-cache-memory", "4MiB", *extra]


def open_streams(url: str, count: int) -> tuple[list[threading.Thread], dict[int, list[str]], threading.Semaphore]:
    """``count`` long streams in threads; the semaphore is released once per stream at its first event."""
    results: dict[int, list[str]] = {}
    started = threading.Semaphore(0)

    def one(i: int) -> None:
        body = {"prompt": f"s{i}", "max_tokens": 240, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    if not events:
                        started.release()
                    events.append(line.removeprefix("data: "))
        results[i] = events

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results, started


def error_of(events: list[str]) -> dict[str, Any]:
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert "error" in last, last
    return dict(last["error"])


def test_an_engine_that_dies_ends_the_streams_and_the_process_exits_non_zero(chat_model_dir: Path) -> None:  # noqa: F811
    srv = ServerProcess(args(chat_model_dir, "--drain-timeout", "30"), prelude=SLOW_STEPS + FATAL_FAULT)
    with srv:
        threads, results, started = open_streams(srv.url, 2)
        for _ in threads:
            assert started.acquire(timeout=120)
        trigger = httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "seed": FATAL_SEED}, timeout=60
        )
        assert trigger.status_code == 500 and "engine" in trigger.json()["error"]["message"]
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a stream hung after the engine died"
        # Exits on its own, well inside the drain deadline: nothing in flight can finish.
        code = srv.wait(timeout=60)
        log = srv.log()
    assert code == 1, log[-2000:]
    for i in range(2):
        error = error_of(results[i])
        assert error["code"] == 500 and "engine" in error["message"].lower(), error
    assert "plimsoll serve: the engine failed: injected: CUDA error" in log


def test_at_the_drain_deadline_streams_are_cut_cleanly_and_the_log_has_no_traceback(chat_model_dir: Path) -> None:  # noqa: F811
    # 240 tokens at >= 50 ms a step is >= 12 s: neither stream can finish inside a 2 s drain.
    srv = ServerProcess(args(chat_model_dir, "--drain-timeout", "2"), prelude=SLOW_STEPS)
    with srv:
        threads, results, started = open_streams(srv.url, 2)
        for _ in threads:
            assert started.acquire(timeout=120)
        srv.terminate()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
        code = srv.wait(timeout=60)
        log = srv.log()
    assert code == 0, log[-2000:]
    for i in range(2):
        error = error_of(results[i])
        assert error["code"] == 503 and "drain deadline" in error["message"], error
    assert "drain timeout: 2 request(s) still in flight" in log
    finished = [json.loads(line[line.index("{"):]) for line in log.splitlines() if '"request_finished"' in line]
    assert [r["status"] for r in finished if r["endpoint"] == "completions"] == ["shutdown", "shutdown"]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_cpu_server_loads_no_gpu_modules_and_stops_without_a_word_after_its_last_log_line(
    chat_model_dir: Path,  # noqa: F811
    stop: signal.Signals,
) -> None:
    srv = ServerProcess(args(chat_model_dir, "--device", "cpu"))
    with srv:
        assert srv.proc is not None
        reply = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
        srv.proc.send_signal(stop)
        code = srv.wait(timeout=60)
        log = srv.log()
    assert reply.status_code == 200
    assert "libtriton" not in maps and "/triton/" not in maps  # Triton is GPU-only: never imported here
    assert code == (0 if stop == signal.SIGTERM else 128 + signal.SIGINT), log[-2000:]  # 130: a shell's Ctrl-C
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    last = log.rstrip().splitlines()[-1]
    assert "Finished server process" in last, log[-2000:]  # uvicorn's last line, nothing after it
    assert "nanobind" not in log and "leaked" not in log, log[-3000:]
