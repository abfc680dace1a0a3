"""`plimsoll serve`: build the engine and the HTTP app from flags and run them under uvicorn.

Heavy imports (torch, transformers, uvicorn) happen inside the command so that
`plimsoll --help` stays fast. With no ``--model`` the embedded SmolLM2-135M-Instruct
is served.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import typer
from pydantic import BaseModel

from plimsoll.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, KV_SHARED_PASSWORD_ENV, WAKE_API_KEY_ENV
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.startup import STARTUP
from plimsoll.runtime.serving.settings import ServerSettings


def _engine_default(name: str) -> object:
    """A flag's default is the config field's: written once, in the config classes."""
    return EngineConfig.model_fields[name].default


def _server_default(name: str) -> object:
    return ServerSettings.model_fields[name].default


def _config_kwargs(config: type[BaseModel], flags: dict[str, Any], **derived: Any) -> dict[str, Any]:
    """The arguments of ``config`` from the flags: each flag named after one of its fields as given,
    ``derived`` (what flags were checked or converted into) in their place, and None left out so
    that a flag not given leaves the field's default."""
    given = {name: value for name, value in flags.items() if name in config.model_fields}
    return {name: value for name, value in {**given, **derived}.items() if value is not None}


def _fail(message: str) -> None:
    typer.echo(f"plimsoll serve: {message}", err=True)
    raise typer.Exit(code=2)


def _compilation_config(text: str | None, cache_dir: str | None) -> object:
    """``--compilation-config`` with ``--compilation-cache-dir`` folded in as its ``cache_dir``."""
    from plimsoll.runtime.engine.compilation_config import CompilationConfig

    if cache_dir is None:
        return text if text is not None else {}
    try:
        parsed = CompilationConfig.parse(text) if text is not None else {}
    except ValueError as exc:
        _fail(str(exc))
    if not isinstance(parsed, dict):
        _fail(f"--compilation-config must be a JSON object or a mode number, got {text!r}")
    return {**parsed, "cache_dir": cache_dir}  # type: ignore[dict-item]


def collector_off_while_starting(command: Callable[..., None]) -> Callable[..., None]:
    """Run ``command`` with Python's cyclic garbage collector off until the server is Ready.

    Start-up creates what lives as long as the process (torch's and the server's modules, the
    model, the app): the collector, run by allocation counts, walks all of it again and again
    for nothing, about a tenth of the imports' CPU. ``on_ready`` collects once, freezes what is
    alive and turns the collector back on; whatever way the command ends, it is on again.
    """

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        was_on = gc.isenabled()
        gc.disable()
        try:
            command(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()

    return run


@collector_off_while_starting
def serve(
    model_arg: str | None = typer.Argument(
        None,
        metavar="MODEL",
        help="Model to serve, as in `vllm serve MODEL` (same as --model).",
        show_default=False,
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="HF-format model directory, a .gguf file, or 'smollm2-135m' (embedded; the default).",
        show_default=False,
    ),
    served_model_name: list[str] | None = typer.Option(
        None,
        "--served-model-name",
        help="Name clients send as `model` (default: --model).",
        show_default=False,
    ),
    host: str = typer.Option("0.0.0.0", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to bind."),
    max_num_seqs: int = typer.Option(
        _engine_default("max_num_seqs"), "--max-num-seqs", min=1, help="Most sequences in one batch."
    ),
    max_num_batched_tokens: int = typer.Option(
        _engine_default("max_num_batched_tokens"),
        "--max-num-batched-tokens",
        min=1,
        help="Token budget of one engine step.",
    ),
    kv_cache_memory: str | None = typer.Option(
        None,
        "--kv-cache-memory",
        help="Size of the paged KV cache, e.g. 2GiB (default: sized from the GPU; 1GiB on CPU).",
        show_default=False,
    ),
    kv_cache_memory_bytes: int | None = typer.Option(
        None,
        "--kv-cache-memory-bytes",
        min=1,
        help="KV cache size in bytes (vLLM's flag; or --kv-cache-memory).",
    ),
    gpu_memory_utilization: float | None = typer.Option(
        None,
        "--gpu-memory-utilization",
        help="Share of the GPU's memory this server may hold (vLLM's flag, default 0.9 on CUDA): the KV "
        "cache gets what the weights, the largest step and the CUDA graphs leave. "
        "--kv-cache-memory-bytes overrides it.",
    ),
    block_size: int = typer.Option(
        _engine_default("block_size"), "--block-size", min=1, help="Tokens per KV-cache block."
    ),
    enable_prefix_caching: bool = typer.Option(
        _engine_default("enable_prefix_caching"),
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse KV blocks of shared prompt prefixes.",
    ),
    max_model_len: int | None = typer.Option(
        None,
        "--max-model-len",
        min=2,
        help="Longest prompt + completion (default: the model's, capped at 4096).",
    ),
    max_new_tokens_flag: int | None = typer.Option(
        None,
        "--max-new-tokens",
        min=1,
        help="max_tokens for requests that send none, and the most any request gets (larger ones are "
        "lowered to it); default: the rest of the context.",
    ),
    override_generation_config: str | None = typer.Option(
        None,
        "--override-generation-config",
        help="vLLM's form of --max-new-tokens: '{\"max_new_tokens\": 512}' (its only key read here).",
    ),
    max_waiting: int | None = typer.Option(
        None,
        "--max-waiting",
        min=0,
        help="Waiting requests beyond which new ones get 429 (default: unlimited).",
    ),
    request_timeout: float | None = typer.Option(
        None, "--request-timeout", min=0.001, help="Seconds after which a request is aborted (default: none)."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar=API_KEY_ENV, help="Require `Authorization: Bearer KEY` on /v1/* "
        f"(or ${API_KEY_ENV}, which keeps the key out of the process's arguments)."
    ),
    admin_api_key: str | None = typer.Option(
        None, "--admin-api-key", envvar=ADMIN_API_KEY_ENV,
        help="Require `Authorization: Bearer KEY` on the control endpoints (/drain, PUT /slo, LoRA load/unload, "
        f"/debug/*); without it they answer loopback clients only (or ${ADMIN_API_KEY_ENV}).",
        show_default=False,
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="auto (float32 on CPU, bfloat16 on GPU), bfloat16|bf16, float16|half or float32.",
    ),
    device: str = typer.Option(
        "auto", "--device", help="auto (cuda when torch sees a CUDA GPU, else cpu), cpu, cuda or cuda:N."
    ),
    attention_backend: str = typer.Option(
        "auto",
        "--attention-backend",
        help="auto (triton on CUDA when the triton package is installed, else torch), torch or triton.",
    ),
    enforce_eager: bool = typer.Option(
        False,
        "--enforce-eager",
        help="Never replay CUDA graphs (by default, on CUDA with --attention-backend triton, decode steps "
        "replay graphs captured at start).",
    ),
    compilation_config: str | None = typer.Option(
        None,
        "--compilation-config",
        "-O",
        help='vLLM\'s JSON (\'{"mode": 3, "cache_dir": "/cache/compile"}\') or a mode number: 3 compiles the '
        "forward with torch.compile (the default on CUDA), 0 runs it eagerly (docs/gpu.md).",
    ),
    compilation_cache_dir: str | None = typer.Option(
        None,
        "--compilation-cache-dir",
        help="Keep torch.compile's and Triton's caches here (the compilation config's cache_dir): mount a "
        "volume so a restart loads the compiled graphs instead of compiling again.",
    ),
    scheduling_policy: str = typer.Option(
        _engine_default("scheduling_policy"),
        "--scheduling-policy",
        help="continuous (admit new requests every step), static (admit a new batch only when the "
        "running one has drained; for comparison, see docs/runtime.md) or priority (the request's "
        "`priority` decides, lower first; fair share across x-gateway-inference-fairness-id tenants).",
    ),
    max_tenant_inflight_tokens: int | None = typer.Option(
        None,
        "--max-tenant-inflight-tokens",
        min=1,
        help="Prompt + max_tokens one tenant (x-gateway-inference-fairness-id, else `user`) may have in "
        "flight; beyond it new requests get 429 (default: unlimited).",
    ),
    enable_prompt_tokens_details: bool = typer.Option(
        _server_default("enable_prompt_tokens_details"),
        "--enable-prompt-tokens-details",
        help="Report usage.prompt_tokens_details.cached_tokens (vLLM's flag). Off by default: the count "
        "tells a client whether a prompt with its salt was cached.",
    ),
    tenant_cache_isolation: bool = typer.Option(
        _server_default("tenant_cache_isolation"),
        "--tenant-cache-isolation/--no-tenant-cache-isolation",
        help="Salt the prefix cache with the tenant (x-gateway-inference-fairness-id, set by the router or "
        "gateway), so tenants never share cached blocks.",
    ),
    min_client_priority: int = typer.Option(
        _server_default("min_client_priority"),
        "--min-client-priority",
        help="The body's `priority` is raised to at least this (vLLM: lower runs first), so clients can lower "
        "their own priority but not jump ahead; x-gateway-inference-objective priorities are not clamped.",
    ),
    inference_objective: list[str] = typer.Option(
        [],
        "--inference-objective",
        help="NAME=PRIORITY (repeatable): a request whose x-gateway-inference-objective header names NAME "
        "gets that InferenceObjective's spec.priority (higher is more important; served as vLLM "
        "priority -PRIORITY). An unknown name gets 400.",
    ),
    otlp_traces_endpoint: str | None = typer.Option(
        None,
        "--otlp-traces-endpoint",
        envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        help="OTLP/HTTP URL to send OpenTelemetry traces to, e.g. http://collector:4318/v1/traces.",
    ),
    seed: int = typer.Option(
        _engine_default("seed"), "--seed", help="Seed for requests that do not send one."
    ),
    quantization: str | None = typer.Option(
        None,
        "--quantization",
        help="int8: weight-only, a scale and offset per 32 inputs of a row; fp8: e4m3 weights with a scale "
        "per output channel and activations scaled per token (compute capability 8.9+); both computed at "
        "load (docs/quantization.md). An FP8 checkpoint (quantization_config in config.json) is served as fp8.",
    ),
    cpu_kernels: str = typer.Option(
        _engine_default("cpu_kernels"),
        "--cpu-kernels",
        help="Which build of the C++ CPU kernels to run: auto (the best this CPU runs), avx512, avx2, plain, "
        "or off (torch's ops alone). Built at install; the start-up line names the one in use.",
    ),
    cpu_packed_weights: bool = typer.Option(
        _engine_default("cpu_packed_weights"),
        "--cpu-packed-weights/--no-cpu-packed-weights",
        help="On CPU, keep float32 projections and the head also packed in column panels (faster steps, a "
        "second copy of those weights in memory).",
    ),
    kv_cache_dtype: str = typer.Option(
        "auto",
        "--kv-cache-dtype",
        help="KV cache storage: auto (the model dtype) or int8 (a float32 scale per token and KV head).",
    ),
    kv_offloading_backend: str | None = typer.Option(
        None, "--kv-offloading-backend",
        help="native: keep blocks evicted from the KV cache in host memory and load them back on a prefix "
        "hit (vLLM's flag; --kv-offloading-size alone implies it).",
    ),
    kv_offloading_size: float | None = typer.Option(
        None, "--kv-offloading-size", help="GiB of host memory for evicted KV blocks (vLLM's flag)."
    ),
    kv_offloading_store_threshold: int = typer.Option(
        0, "--kv-offloading-store-threshold",
        help="Offload a block only after lookups asked for it this many times (vLLM's store_threshold; 0: all).",
    ),
    kv_offloading_disk_path: str | None = typer.Option(
        None, "--kv-offloading-disk-path", help="Directory of a disk tier below the host tier (emptied at start)."
    ),
    kv_offloading_disk_size: float | None = typer.Option(
        None, "--kv-offloading-disk-size", help="GiB of the disk tier."
    ),
    kv_shared_url: str | None = typer.Option(
        None, "--kv-shared-url",
        help="redis://HOST:PORT of a Valkey or Redis server shared by the replicas: blocks computed on one "
        "replica are hits on the others.",
    ),
    kv_shared_password: str | None = typer.Option(
        None, "--kv-shared-password", envvar=KV_SHARED_PASSWORD_ENV, show_default=False,
        help="Password of the shared tier's server (Valkey/Redis AUTH). Prefer the environment variable: a "
        "flag's value is visible in the process list.",
    ),
    kv_shared_timeout: float = typer.Option(
        0.25, "--kv-shared-timeout", help="Seconds one shared-tier call may take before the request recomputes."
    ),
    kv_events_config: str | None = typer.Option(
        None, "--kv-events-config",
        help='vLLM\'s KV events JSON: \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557"}\' (BlockStored/BlockRemoved/AllBlocksCleared, msgpack).',
    ),
    kv_transfer_config: str | None = typer.Option(
        None, "--kv-transfer-config",
        help='vLLM\'s prefill/decode disaggregation JSON: \'{"kv_role": "kv_producer"}\' (prefill, hold the blocks '
        'for a pull), "kv_consumer" (pull them, then decode) or "kv_both"; kv_connector left out uses the built-in '
        'TCP transport on kv_port (default 14579; 0 picks one). See docs/operator.md.',
    ),
    speculative_config: str | None = typer.Option(
        None,
        "--speculative-config",
        help='Speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or \'{"model": DIR, "num_speculative_tokens": 4}\' (see docs/runtime.md).',
    ),
    tensor_parallel_size: int = typer.Option(
        _engine_default("tensor_parallel_size"),
        "--tensor-parallel-size",
        "-tp",
        min=1,
        help="Ranks (one process each; one GPU each on CUDA) that split attention heads and MLP columns "
        "(vLLM's flag). The KV cache size is per rank.",
    ),
    enable_lora: bool = typer.Option(
        False,
        "--enable-lora",
        help="Serve LoRA adapters: `model` picks one; /v1/load_lora_adapter loads more.",
    ),
    lora_modules: list[str] | None = typer.Option(
        None,
        "--lora-modules",
        help='Adapters loaded at start: name=path [name=path ...] or vLLM\'s JSON \'{"name": .., "path": ..}\' '
        "(PEFT directories; needs --enable-lora).",
        show_default=False,
    ),
    max_loras: int = typer.Option(
        _engine_default("max_loras"),
        "--max-loras",
        min=1,
        help="Adapters one engine step can mix (device slots).",
    ),
    max_lora_rank: int = typer.Option(
        _engine_default("max_lora_rank"), "--max-lora-rank", min=1, help="Largest adapter rank accepted."
    ),
    allow_runtime_lora_updating: bool = typer.Option(
        _server_default("allow_runtime_lora_updating"),
        "--allow-runtime-lora-updating",
        envvar="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        help="Answer /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING "
        "is read too); loads are limited to --lora-allowed-roots.",
    ),
    lora_allowed_roots: list[str] = typer.Option(
        [], "--lora-allowed-roots", help="Directory run-time LoRA loads may read from (repeatable)."
    ),
    max_registered_loras: int = typer.Option(
        _server_default("max_registered_loras"),
        "--max-registered-loras",
        min=1,
        help="Adapters registered at once, start-up ones included; a load beyond it gets 400.",
    ),
    max_cpu_loras: int | None = typer.Option(
        None, "--max-cpu-loras", min=1, help="Adapters kept in host memory, LRU (default: --max-loras)."
    ),
    drain_timeout: float = typer.Option(
        _server_default("drain_timeout"),
        "--drain-timeout",
        min=0,
        help="Seconds SIGTERM waits for in-flight requests; then unfinished streams end with an error "
        "event and [DONE] and the process exits (keep it under terminationGracePeriodSeconds).",
    ),
    max_request_bytes: int = typer.Option(
        _server_default("max_request_bytes"),
        "--max-request-bytes",
        min=1024,
        help="Largest request body; larger ones get 413.",
    ),
    allow_client_chat_template: bool = typer.Option(
        _server_default("allow_client_chat_template"),
        "--allow-client-chat-template",
        help="Accept a chat_template in chat_template_kwargs (rendering one costs unbounded CPU).",
    ),
    enable_profiling: bool = typer.Option(
        _server_default("enable_profiling"),
        "--enable-profiling",
        help="Answer POST /debug/profile?seconds=S&kind=torch|py-spy (a control endpoint: --admin-api-key); "
        "fetch one with `plimsoll profile`.",
    ),
    profile_dir: str | None = typer.Option(
        None, "--profile-dir", help="Where profiles are also written (default: a fresh $TMPDIR/plimsoll-profiles-XXXX, mode 0700)."
    ),
    enable_sleep_mode: bool = typer.Option(
        False,
        "--enable-sleep-mode",
        help="Answer POST /sleep?level=1|2 and POST /wake_up (vLLM's flag; admin endpoints): level 1 frees "
        "the KV cache and moves the weights to host memory (on CPU they are there already), level 2 drops "
        "them too and reloads them on wake. GET /is_sleeping says which.",
    ),
    slo_admission: bool = typer.Option(
        False,
        "--slo-admission",
        help="Refuse (429, Retry-After) a request whose predicted TTFT exceeds the TTFT objective set by "
        "PUT /slo, when it carries no x-slo-ttft-ms header of its own (a header is honoured either way).",
    ),
    wake_api_key: str | None = typer.Option(
        None, "--wake-api-key", envvar=WAKE_API_KEY_ENV, show_default=False,
        help=f"A key POST /wake_up also takes, and no other path: what a router holds (or ${WAKE_API_KEY_ENV}).",
    ),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    metrics_compat: str | None = typer.Option(
        None,
        "--metrics-compat",
        help="Also export this engine's metric names: vllm (vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:cache_config_info), "
        "what a Gateway API Inference Extension endpoint picker reads.",
    ),
) -> None:
    """Run the inference server (OpenAI-compatible API, /health, /ready, /metrics)."""
    import uvicorn
    from pydantic import ValidationError

    from plimsoll.objectives import parse_objectives
    from plimsoll.runtime.engine.async_engine import AsyncEngine
    from plimsoll.runtime.engine.config import EngineConfig
    from plimsoll.runtime.serve_args import (
        ServeArgError,
        check_device,
        check_model,
        check_port,
        check_triton_toolchain,
        choose_model,
        environment_malloc_settings,
        kv_cache_bytes,
        max_new_tokens,
        parse_lora_module,
        resolve_attention_backend,
        resolve_device,
        resolve_dtype,
        served_name,
    )
    from plimsoll.runtime.serve_args import (
        gpu_memory_utilization as check_utilization,
    )
    from plimsoll.runtime.serving.lifecycle import DrainingServer
    from plimsoll.runtime.serving.metrics import ServerMetrics
    from plimsoll.runtime.serving.server import build_app
    from plimsoll.runtime.serving.settings import ServerSettings

    STARTUP.mark("imports")  # torch, transformers, uvicorn and the server are loaded
    # Mistakes a newcomer makes first fail here, in one line, before the model loads or the port binds.
    try:
        model = choose_model(model_arg, model)
        served = served_name(served_model_name)
        new_tokens = max_new_tokens(max_new_tokens_flag, override_generation_config)
        device = resolve_device(device)
        check_device(device)
        attention_backend = resolve_attention_backend(attention_backend, device)
        if attention_backend == "triton" and device.startswith("cuda"):
            check_triton_toolchain()
        dtype = resolve_dtype(dtype, device)
        check_model(model)
        kv_size = kv_cache_bytes(kv_cache_memory, kv_cache_memory_bytes)
        utilization = check_utilization(gpu_memory_utilization, device)
        loras = [parse_lora_module(text) for text in lora_modules or []]
        if loras and not enable_lora:
            raise ServeArgError("--lora-modules needs --enable-lora")
        check_port(host, port)
        objectives = parse_objectives(inference_objective)
    except (ServeArgError, ValueError) as exc:
        _fail(str(exc))
        return
    # The flags as the checks left them: model, device, attention backend and dtype are resolved now.
    here = locals()
    flags = {name: here[name] for name in inspect.signature(serve).parameters}
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    malloc_settings = environment_malloc_settings()  # the process's own malloc rules win (kernels/host_memory.py)
    # Read once: child processes (chat-template workers, py-spy, tensor-parallel ranks) need none of these.
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV, WAKE_API_KEY_ENV, KV_SHARED_PASSWORD_ENV):
        os.environ.pop(name, None)
    try:
        config = EngineConfig(
            **_config_kwargs(
                EngineConfig,
                flags,
                served_model_name=served,
                kv_cache_memory=kv_size,
                gpu_memory_utilization=utilization,
                compilation_config=_compilation_config(compilation_config, compilation_cache_dir),
                lora_modules=loras,
                kv_shared_timeout_s=kv_shared_timeout,
                keep_freed_memory=malloc_settings is None,
            )
        )
        settings = ServerSettings(
            **_config_kwargs(
                ServerSettings,
                flags,
                served_model_name=config.display_name,
                lora_allowed_roots=tuple(lora_allowed_roots),
                max_new_tokens=new_tokens,
                inference_objectives=objectives,
            )
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        _fail(f"invalid settings: {problems}")
        return

    if metrics_compat not in (None, "vllm"):
        _fail(f"--metrics-compat {metrics_compat!r}: the only compatible family is vllm")
    if malloc_settings is not None:
        logging.getLogger("plimsoll.serve").info("malloc thresholds left as they are: %s", malloc_settings)
    if otlp_traces_endpoint:
        from plimsoll.tracing import configure_tracing

        configure_tracing("plimsoll-serve", otlp_traces_endpoint)
    metrics = ServerMetrics(settings.served_model_name, metrics_compat=metrics_compat)
    engine = AsyncEngine(config, observer=metrics)
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.begin_drain()  # finish what can finish, then exit 1 so the kubelet restarts us

    def on_ready() -> None:
        # What is alive now (modules, the model, the server) lives as long as the process: out of the
        # cyclic GC's way, so its collections during steps scan only what requests allocate (vLLM's
        # engine does the same). Done here, not in the engine: a test process builds many engines.
        gc.collect()
        gc.freeze()
        gc.enable()  # off while starting (collector_off_while_starting)

    app = build_app(engine, settings, metrics, on_fatal=on_fatal, on_ready=on_ready)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        access_log=False,  # one structured line per request is logged by the server instead
        # The drain deadline covers everything (DrainingServer cuts streams itself at
        # --drain-timeout); uvicorn's own wait after that is only for sockets to close.
        timeout_graceful_shutdown=1,
        timeout_keep_alive=30,
    )
    server = DrainingServer(uv_config, app.state.ctx)
    server.run()
    if failed:
        typer.echo(f"plimsoll serve: the engine failed: {failed[0]}", err=True)
        raise typer.Exit(code=1)
