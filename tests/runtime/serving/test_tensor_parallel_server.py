"""`plimsoll serve --tensor-parallel-size 2` through HTTP: TP=1's greedy text, and a clean death.

One real server process (rank 0: scheduler and HTTP) with one spawned worker rank,
driven by the official openai client. The second test kills the worker with
SIGKILL mid-stream: the stream ends with an error and the server exits non-zero
within its drain deadline instead of hanging in a collective.
"""

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_fixtures import chat_model_dir  # noqa: F401  (fixture)

from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.testing import ServerProcess

DRAIN_TIMEOUT_S = 5
# A bound for "did not hang", not a speed figure: the drain deadline plus process exit on a busy host.
EXIT_BOUND_S = DRAIN_TIMEOUT_S + 60
PROMPTS = ["The plimsoll line", "tensor parallel", "x"]


@pytest.fixture(scope="module")
def tp_server(chat_model_dir: Path) -> Iterator[ServerProcess]:  # noqa: F811
    args = ["--model", str(chat_model_dir), "--tensor-parallel-size", "2", "--kv-cache-memory", "2MiB"]
    args += ["--max-model-len", "256", "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    with ServerProcess(args, startup_timeout=300) as server:
        yield server


@pytest.fixture(scope="module")
def client(tp_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_tp2_server_answers_with_tp1_greedy_text(client: openai.OpenAI, chat_model_dir: Path) -> None:  # noqa: F811
    with LLM(model=str(chat_model_dir), kv_cache_memory="2MiB", max_model_len=256) as llm:
        ref = [
            o.outputs[0].text
            for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        ]
    model = client.models.list().data[0].id
    got = []
    for prompt in PROMPTS:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        got.append(out.choices[0].text)
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert got == ref
    assert streamed == ref[0]


def test_killing_the_worker_rank_ends_the_server_non_zero(
    tp_server: ServerProcess, client: openai.OpenAI
) -> None:
    found = re.search(r"tensor-parallel rank 1 started: pid (\d+)", tp_server.log())
    assert found, tp_server.log()
    worker_pid = int(found.group(1))
    model = client.models.list().data[0].id
    first_chunk = threading.Event()
    outcome: list[BaseException | str] = []

    def stream() -> None:
        text = ""
        try:
            for chunk in client.completions.create(
                model=model,
                prompt="long",
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                first_chunk.set()
                text += chunk.choices[0].text if chunk.choices else ""
            outcome.append(text)
        except BaseException as exc:  # the error event (APIError) or a cut connection
            outcome.append(exc)
        finally:
            first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(120)
    killed_at = time.monotonic()
    os.kill(worker_pid, signal.SIGKILL)
    code = tp_server.wait(timeout=EXIT_BOUND_S)
    exit_s = time.monotonic() - killed_at
    reader.join(30)
    log = tp_server.log()
    print(f"exit code {code} {exit_s:.1f}s after the kill; stream ended with {outcome!r}")
    assert code == 1, log
    assert "tensor-parallel rank 1" in log and "exited with code -9" in log, log
    assert outcome and isinstance(outcome[0], BaseException), outcome  # 200 tokens never completed
