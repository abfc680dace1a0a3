"""Helpers for tests that need a real model or a real `plimsoll serve` process.

What it is: ``write_tiny_model`` writes a random-initialised Llama-family model
directory (safetensors + config + a byte-level tokenizer with a chat template),
so engine and server tests run on a CPU with nothing fetched from a hub.
``ServerProcess`` starts `plimsoll serve` as a subprocess on 127.0.0.1 with a free
port and waits for ``/ready``; router, bench and operator tests reuse it.

What it is not: a fake. The model is tiny but real (transformers can load it and
``generate()`` with it); the server is the real command line.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from plimsoll.readiness import wait_until_ready

if TYPE_CHECKING:
    from plimsoll.runtime.engine.llm_engine import LLMEngine
    from plimsoll.runtime.engine.outputs import RequestOutput

# A minimal ChatML-style template: enough structure that a chat request and a
# completion request tokenize differently, and an assistant turn ends in eos.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer(chat_template: bool = True) -> Any:
    """A 259-id byte-level tokenizer: <pad>=0, <s>=1, </s>=2, then the 256 byte symbols.

    BPE with no merges over the ByteLevel alphabet round-trips any UTF-8 text,
    one token per byte, which keeps token counts predictable in tests.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


# The sizes a Llama-family config.json names, in the order ``llama_shape`` takes them.
LLAMA_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def llama_shape(*sizes: int, rope_theta: float | None = None, tied: bool = False) -> dict[str, Any]:
    """A Llama-family model's shape as ``LlamaConfig`` keyword arguments, for a random checkpoint of
    a real model's size (the GPU checks and benchmarks): ``sizes`` in ``LLAMA_SIZES`` order, one model
    a line, as a table's row; ``rope_theta=None`` keeps the config's default."""
    shape: dict[str, Any] = dict(zip(LLAMA_SIZES, sizes, strict=True), tie_word_embeddings=tied)
    if rope_theta is not None:
        shape["rope_theta"] = rope_theta
    return shape


# The tiny model's shapes; tests/runtime/tiny_models.py varies them per architecture.
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=0.3,
)


def write_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a random-initialised tiny model directory at ``path`` and return it.

    ``arch`` is ``"llama"`` or ``"qwen3"``. Weights are fp32 with
    ``initializer_range=0.3`` so greedy top-1/top-2 logit margins stay wide
    enough for token-exact comparisons. Idempotent: an existing complete
    directory is left as it is.
    """
    from transformers import LlamaConfig, Qwen3Config

    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    common = dict(TINY_SHAPE)
    if arch == "llama":
        config: object = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=16)
    else:
        raise ValueError(f"write_tiny_model: unknown arch {arch!r}; use 'llama' or 'qwen3'")
    return save_random_model(out, config, seed=seed)


def save_random_model(
    directory: str | Path, config: Any, seed: int = 0, chat_template: bool = True, **from_config: Any
) -> Path:
    """Random weights for the transformers ``config`` (fp32 unless ``dtype`` is given), saved with the
    byte-level tokenizer at ``directory``: the one factory of the tiny and benchmark-sized test models."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(directory)
    torch.manual_seed(seed)
    from_config.setdefault("dtype", torch.float32)
    model = AutoModelForCausalLM.from_config(config, **from_config)  # type: ignore[no-untyped-call,unused-ignore]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    byte_level_tokenizer(chat_template=chat_template).save_pretrained(out)
    return out


def write_random_lora(
    base: str | Path,
    path: str | Path,
    r: int = 8,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    lora_alpha: float = 16.0,
    seed: int = 0,
    scale: float = 1.0,
) -> Path:
    """A random PEFT LoRA adapter for the model in ``base``, written by peft itself.

    Both A and B are random (peft's ``init_lora_weights=False``; B is zero after a
    real initialisation, which would make the adapter a no-op), B multiplied by
    ``scale``. Idempotent like ``write_tiny_model``.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(path)
    if (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    # peft annotates lora_alpha as int; it only scales by alpha / r, and fractional alphas are valid.
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,  # type: ignore[arg-type]
        target_modules=list(target_modules),
        init_lora_weights=False,
    )
    with warnings.catch_warnings():
        # peft calls a transformers API that transformers marks deprecated: not ours to fix.
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, config)
    if scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
    peft_model.save_pretrained(str(out))
    return out


def pod_model(max_positions: int = 1024) -> Path:
    """The tiny random model for pods the devcluster pod runner starts, written once.

    It lives under ``~/.cache/plimsoll/test-models`` rather than /tmp, because a
    replica pod mounts an emptyDir at /tmp and the pod runner maps paths under a
    mount to the pod's scratch directory, as a kubelet's mount would hide them.
    Its context is widened to ``max_positions``: bench calibrates words→tokens with
    a probe longer than the 256 positions written, and RoPE has no learned
    positions, so a longer context is only a config value.
    """
    model = write_tiny_model(Path.home() / ".cache" / "plimsoll" / "test-models" / "tiny-llama-1k")
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    if config["max_position_embeddings"] < max_positions:
        config["max_position_embeddings"] = max_positions
        config_path.write_text(json.dumps(config, indent=2))
    return model


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ThreadedServer:
    """The real server (AsyncEngine + app + uvicorn) on a background thread of this process.

    Same HTTP stack as `plimsoll serve` (``DrainingServer``, real sockets on
    127.0.0.1) without paying a fresh interpreter's torch import, which on a busy
    CI machine costs tens of seconds. ``engine`` takes ``EngineConfig`` fields,
    ``server`` takes ``ServerSettings`` fields. ``drain()`` starts the SIGTERM
    drain path without a signal (signals only reach the main thread).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        host: str = "127.0.0.1",
        startup_timeout: float = 120.0,
        server: dict[str, object] | None = None,
        step_delay: float = 0.0,
        **engine: object,
    ) -> None:
        self.host = host
        self.step_delay = step_delay
        self.fatal: list[BaseException] = []
        self.port = free_port(host)
        self.model = str(model)
        self.engine_kwargs = engine
        self.server_kwargs = server or {}
        self.startup_timeout = startup_timeout
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ThreadedServer:
        import uvicorn

        from plimsoll.runtime.engine.async_engine import AsyncEngine
        from plimsoll.runtime.engine.config import EngineConfig
        from plimsoll.runtime.serving.lifecycle import DrainingServer
        from plimsoll.runtime.serving.metrics import ServerMetrics
        from plimsoll.runtime.serving.server import build_app
        from plimsoll.runtime.serving.settings import ServerSettings

        config = EngineConfig(model=self.model, **self.engine_kwargs)
        settings = ServerSettings(
            served_model_name=config.display_name, **self.server_kwargs
        )
        self.metrics = ServerMetrics(settings.served_model_name)
        self.engine = AsyncEngine(config, observer=self.metrics)

        def on_fatal(exc: BaseException) -> None:  # what `plimsoll serve` does: drain, then exit 1
            self.fatal.append(exc)
            self.server.begin_drain()

        self.app = build_app(self.engine, settings, self.metrics, on_fatal=on_fatal)
        self.ctx = self.app.state.ctx
        uv = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self.server = DrainingServer(uv, self.ctx)

        def run() -> None:
            try:
                self.server.run()
            except BaseException as exc:  # reported by wait_ready / stop
                self._error = exc

        self._thread = threading.Thread(target=run, name="plimsoll-test-server", daemon=True)
        self._thread.start()
        thread = self._thread

        def died() -> str | None:
            if self._error is None and thread.is_alive():
                return None
            return f"the server thread stopped before /ready: {self._error!r}"

        if wait_until_ready(f"{self.url}/ready", self.startup_timeout, died, interval_s=0.1):
            if self.step_delay:
                self._slow_down_steps(self.step_delay)
            return self
        self.stop()
        raise TimeoutError(f"server not ready after {self.startup_timeout}s")

    def _slow_down_steps(self, seconds: float) -> None:
        """Make every engine step take at least ``seconds``: a step is then slow on any CPU.

        Timeout and abort tests use it so "the request is still running when X
        happens" holds however fast the machine is.
        """
        core = self.engine.engine
        if core is None:
            raise RuntimeError("the engine has not started; call start() first")
        step = core.step

        def slow_step() -> Any:
            time.sleep(seconds)
            return step()

        # A deliberate instance patch: the engine thread looks the method up on every iteration.
        core.step = slow_step  # type: ignore[method-assign]

    def drain(self) -> None:
        """What SIGTERM does: stop admission, finish in-flight requests, then stop."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ThreadedServer:
        return self if self._thread is not None else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ServerProcess:
    """`plimsoll serve` in a subprocess on 127.0.0.1, ready when the block is entered.

    ``with ServerProcess(["--model", str(model_dir)]) as server:`` starts it, polls
    ``/ready`` until it answers 200 (or the process dies, or ``startup_timeout``
    passes, each a clear error carrying the server's log), and on exit sends
    SIGTERM and waits. ``server.url`` is ``http://127.0.0.1:PORT``; ``server.log()``
    returns everything the process wrote so far. ``prelude`` is Python run in the server
    process before the CLI (a test's fault injection or slow step, patched into the real
    engine classes), so the process stays the real `plimsoll serve`.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        prelude: str = "",
    ) -> None:
        self.host = host
        self.prelude = prelude
        self.port = port if port is not None else free_port(host)
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self.env = env  # the server's whole environment; None: this process's
        self.proc: subprocess.Popen[bytes] | None = None
        # Closed in __exit__; the file outlives the process so a failing test can show the log.
        self._log = tempfile.NamedTemporaryFile(prefix="plimsoll-serve-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> ServerProcess:
        cmd = [
            sys.executable,
            "-c",
            f"{self.prelude}\nfrom plimsoll.cli import main; main()",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(
            [*cmd, *self.args], stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None

        def died() -> str | None:
            if proc.poll() is None:
                return None
            return f"plimsoll serve exited with code {proc.returncode} before /ready:\n{self.log()}"

        if wait_until_ready(f"{self.url}/ready", self.startup_timeout, died):
            return
        self.stop()
        raise TimeoutError(f"plimsoll serve not ready after {self.startup_timeout}s:\n{self.log()}")

    def terminate(self) -> None:
        """Send SIGTERM (graceful drain) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._log.close()


class KeyValueServer:
    """A real Valkey (or Redis) server process on 127.0.0.1 and a free port, for the shared KV tier.

    ``valkey-server`` is preferred, ``redis-server`` taken when Valkey is not installed (``.ci/run``
    installs one of them). Nothing is persisted (no RDB, no AOF); ``maxmemory`` with
    ``allkeys-lru`` bounds it as the operator's Deployment does. ``kill()`` stops it at once
    (SIGKILL) to test a dead server; ``url`` is ``redis://127.0.0.1:PORT/0``.
    """

    def __init__(self, maxmemory: str = "256mb", port: int | None = None, password: str | None = None) -> None:
        import shutil

        binary = shutil.which("valkey-server") or shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("no valkey-server or redis-server on PATH; install one (apt-get install redis-server)")
        self.binary = binary
        self.port = port if port is not None else free_port()
        self.maxmemory = maxmemory
        self.password = password  # requirepass: clients must AUTH (the operator's Valkey has one)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> KeyValueServer:
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (and asking for the password)
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.binary} did not answer PING on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> KeyValueServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@dataclass
class ClosedLoopRun:
    """What :func:`run_closed_loop` measured: the finished outputs and the time they took."""

    outputs: list[RequestOutput]  # in the order they finished
    first_wave: set[str]  # ids of the opening burst, which queue behind each other
    wall_s: float
    cpu_s: float  # this process's CPU time over the same span

    @property
    def steady(self) -> list[RequestOutput]:
        """The outputs without the opening burst (all of them when nothing came after it)."""
        return [o for o in self.outputs if o.request_id not in self.first_wave] or self.outputs

    @property
    def out_tokens(self) -> int:
        return sum(o.metrics.num_generation_tokens for o in self.outputs)

    def tpot_s(self) -> list[float]:
        """Seconds per output token after the first, per steady request with more than one."""
        return [
            (o.metrics.last_token_time - o.metrics.first_token_time) / (o.metrics.num_generation_tokens - 1)  # type: ignore[operator]
            for o in self.steady
            if o.metrics.num_generation_tokens > 1
        ]


def run_closed_loop(engine: LLMEngine, concurrency: int, total: int, add: Callable[[int], str]) -> ClosedLoopRun:
    """Drive ``engine`` in process with ``concurrency`` requests in flight until ``total`` have finished.

    ``add(i)`` adds request number ``i`` to the engine and returns its id; a new one is
    added as each finishes. The benchmark scripts measure engine throughput with it.
    """
    outputs: list[RequestOutput] = []
    first_wave = {add(i) for i in range(min(concurrency, total))}
    issued = len(first_wave)
    t0, cpu0 = time.monotonic(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs.append(out)
                if issued < total:
                    add(issued)
                    issued += 1
    return ClosedLoopRun(outputs, first_wave, time.monotonic() - t0, time.process_time() - cpu0)
