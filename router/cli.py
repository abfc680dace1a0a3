"""`plimsoll route`: run the queue-aware, prefix-affine router."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer

from plimsoll.auth import API_KEY_ENV, WAKE_API_KEY_ENV
from plimsoll.router.config import Policy


def read_tenant_keys(folder: Path) -> dict[str, str]:
    """``{key: tenant}`` from a directory of ``<tenant>`` files holding keys (a Secret mounted as a volume).

    Dot-files (the kubelet's ``..data`` links) are skipped; ValueError for an empty key or
    one key given to two tenants.
    """
    if not folder.is_dir():
        raise ValueError(f"--tenant-keys-dir {folder} is not a directory; mount the tenants' Secret there")
    keys: dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        key = path.read_text().strip()
        if not key:
            raise ValueError(f"--tenant-keys-dir: the key file of tenant {path.name!r} is empty")
        if key in keys:
            raise ValueError(f"--tenant-keys-dir: tenants {keys[key]!r} and {path.name!r} have the same key")
        keys[key] = path.name
    return keys


def _pair(text: str) -> tuple[str, str]:
    url, sep, endpoint = text.partition("=")
    if not sep or not endpoint.startswith("tcp://"):
        raise typer.BadParameter(f"{text!r}: give BACKEND_URL=tcp://HOST:PORT", param_hint="--kv-events-endpoint")
    return url.rstrip("/"), endpoint


def route(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on."),
    backend: list[str] = typer.Option(
        [], "--backend", help="Replica base URL, e.g. http://127.0.0.1:8000 (repeat for each replica)."
    ),
    prefill: list[str] = typer.Option(
        [], "--prefill", help="A split fleet's prefill replica URL (repeatable; with --decode): each request is "
        "prefilled there (max_tokens=1, kv_transfer_params.do_remote_decode) and decoded on a --decode replica."
    ),
    decode: list[str] = typer.Option(
        [], "--decode", help="A split fleet's decode replica URL (repeatable; with --prefill): it pulls the "
        "prompt's KV blocks from the prefill replica, or prefills locally when that fails."
    ),
    decode_policy: Policy = typer.Option(
        Policy.PREFIX_AFFINITY, help="How to pick a decode replica on a split fleet (load and prefix)."
    ),
    prefill_timeout: float = typer.Option(
        120.0, help="Seconds the prefill hop may take before the decode replica prefills locally instead."
    ),
    disaggregated: bool = typer.Option(
        False, help="With --llmservice: the LLMService runs prefill and decode pools (spec.disaggregation); "
        "find each by its pods' plimsoll.dev/role label."
    ),
    llmservice: str | None = typer.Option(None, help="Discover replicas from this LLMService's pods."),
    namespace: str = typer.Option("default", help="Namespace of the LLMService."),
    kubeconfig: str | None = typer.Option(
        None, help="Kubeconfig for --llmservice outside a cluster (default: $KUBECONFIG, ~/.kube/config, "
        "or the pod's ServiceAccount)."
    ),
    backend_port: int = typer.Option(8000, help="Replica port when a pod has no container port named 'http'."),
    policy: Policy = typer.Option(Policy.LEAST_INFLIGHT, help="How to pick a replica."),
    max_inflight_per_replica: int = typer.Option(
        256, help="A replica is saturated at this many requests (router in-flight + its waiting queue); "
        "when all are, answer 429 with Retry-After."
    ),
    retry_after: int = typer.Option(1, help="Seconds to put in Retry-After on 429/503."),
    prefix_chars: int = typer.Option(256, help="Leading prompt characters hashed for prefix affinity."),
    load_factor: float = typer.Option(1.25, help="Bounded load c: skip a replica above c x average load."),
    virtual_nodes: int = typer.Option(128, help="Hash-ring points per replica."),
    long_request_tokens: int | None = typer.Option(
        None, help="Enable length lanes: requests with estimated prompt + max_tokens >= this go to the long lane."
    ),
    long_lane_replicas: int = typer.Option(1, help="Replicas serving the long lane (with --long-request-tokens)."),
    scrape_interval: float = typer.Option(1.0, help="Seconds between readiness probes and /metrics scrapes."),
    metrics_engine: str | None = typer.Option(None, help="Replica metric family: plimsoll or vllm (default: detect)."),
    hold_queue: int = typer.Option(
        0, help="Hold up to this many requests while no replica is Ready (scale from zero); 0 answers 503 at once."
    ),
    hold_timeout: float | None = typer.Option(
        None, help="Seconds a request may be held (default: twice the measured cold-start p95, at most 600)."
    ),
    release_concurrency: int | None = typer.Option(
        None, help="Release held requests at most this many at a time per ready replica (its verified concurrency)."
    ),
    cold_start_fallback: float = typer.Option(
        60.0, help="Cold start assumed (for Retry-After and the hold timeout) until one is measured."
    ),
    inference_objective: list[str] = typer.Option(
        [], "--inference-objective",
        help="NAME=PRIORITY (repeatable): held requests whose x-gateway-inference-objective header names NAME "
        "are released as that InferenceObjective's spec.priority says (higher first); with --trust-gateway-headers.",
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar=API_KEY_ENV,
        help="Require `Authorization: Bearer KEY` on /v1/* and send it to the replicas (their --api-key); "
        f"from ${API_KEY_ENV} keeps it out of the process's arguments.",
        show_default=False,
    ),
    tenant_keys_dir: Path | None = typer.Option(
        None, "--tenant-keys-dir",
        help="A directory of files named after tenants, each holding that tenant's API key (a mounted Secret); "
        "a client using one is that tenant: the router sets x-gateway-inference-fairness-id, which caps its "
        "tokens in flight and salts its prefix cache on the replicas.",
    ),
    max_request_bytes: int = typer.Option(
        8 * 1024 * 1024, "--max-request-bytes", min=1024, help="Largest request body; larger ones get 413."
    ),
    trust_gateway_headers: bool = typer.Option(
        False, "--trust-gateway-headers",
        help="Forward clients' x-gateway-inference-* headers (only behind a gateway that sets them itself); "
        "by default they are dropped, so a client cannot pick its tenant or objective.",
    ),
    migration_limit: int = typer.Option(
        3, help="Times one request may move to another replica when its replica fails mid-stream "
        "(carried on from the last token the client got); 0 turns in-flight migration off.",
    ),
    migration_wait: float = typer.Option(
        30.0, help="Seconds a request whose replica failed, or that arrives while replicas that served are "
        "away (restarting), waits for a ready replica before it gets 503 with Retry-After."
    ),
    shutdown_delay: float = typer.Option(
        5.0, help="After SIGTERM, seconds to keep serving with /ready 503 before closing the listener."
    ),
    drain_timeout: float = typer.Option(
        120.0, help="After the listener closes, seconds open streams get to finish before they are cut."
    ),
    kv_events_port: int = typer.Option(
        5557, help="--policy precise-prefix: port of each replica's KV event publisher (its --kv-events-config)."
    ),
    kv_events_endpoint: list[str] = typer.Option(
        [], "--kv-events-endpoint",
        help="BACKEND_URL=tcp://HOST:PORT (repeatable): a replica's KV event endpoint, instead of its host and "
        "--kv-events-port.",
    ),
    kv_events_stale_after: float = typer.Option(
        5.0, help="A replica sent work that publishes no KV events for this long is stale: fall back to prefix affinity."
    ),
    kv_tokenizer: str | None = typer.Option(
        None, help="--policy precise-prefix: the replicas' model (directory, .gguf or smollm2-135m) whose tokenizer "
        "hashes prompts into the engine's KV block hashes."
    ),
    kv_block_size: int = typer.Option(16, help="The replicas' KV block size until their events say it."),
    slo_ttft_ms: float | None = typer.Option(
        None, "--slo-ttft-ms", min=1,
        help="Refuse at once (429, Retry-After, x-plimsoll-overload: service) a request every ready replica is "
        "predicted to answer later than this (its own x-slo-ttft-ms wins), and send the others only to replicas "
        "predicted to meet it.",
    ),
    standby_wake: bool = typer.Option(
        True, "--standby-wake/--no-standby-wake",
        help="Wake a parked (standby) replica of the LLMService with POST /wake_up when every ready replica would "
        "pass its target in flight, and let the request wait for it (the operator then takes it in or parks it).",
    ),
    standby_wake_inflight: float | None = typer.Option(
        None, "--standby-wake-inflight", min=0.01,
        help="The in-flight per replica past which a parked replica is woken (default: the autoscaler's target "
        "from the LLMService's status.autoscaler.inputs.targetInFlightPerReplica).",
    ),
    standby_wake_wait: float = typer.Option(
        2.0, "--standby-wake-wait", min=0.01, max=120,
        help="Seconds a request waits for the parked replica its arrival woke before it is routed as usual.",
    ),
    log_level: str = typer.Option("info", help="Log level."),
    otlp_traces_endpoint: str | None = typer.Option(
        None, envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        help="OTLP/HTTP URL for OpenTelemetry traces, e.g. http://collector:4318/v1/traces.",
    ),
) -> None:
    """Run the queue-aware, prefix-affine router in front of plimsoll (or vLLM) replicas."""
    import uvicorn
    from pydantic import ValidationError

    from plimsoll.objectives import parse_objectives
    from plimsoll.router.app import build_app
    from plimsoll.router.config import LaneConfig, RouterConfig
    from plimsoll.router.lifecycle import DrainingRouter

    try:
        objectives = parse_objectives(inference_objective)
        tenant_keys = read_tenant_keys(tenant_keys_dir) if tenant_keys_dir is not None else {}
    except ValueError as exc:
        typer.echo(f"plimsoll route: {exc}", err=True)
        raise typer.Exit(code=2) from None
    try:
        lanes = (
            LaneConfig(long_request_tokens=long_request_tokens, long_lane_replicas=long_lane_replicas)
            if long_request_tokens is not None else None
        )
        config = RouterConfig(
            host=host, port=port, backends=tuple(backend), llmservice=llmservice, namespace=namespace,
            kubeconfig=kubeconfig,
            backend_port=backend_port, policy=policy, max_inflight_per_replica=max_inflight_per_replica,
            retry_after_seconds=retry_after, prefix_chars=prefix_chars, load_factor=load_factor,
            virtual_nodes=virtual_nodes, lanes=lanes, scrape_interval_s=scrape_interval,
            metrics_engine=metrics_engine, hold_queue=hold_queue, hold_timeout_s=hold_timeout,
            slo_ttft_s=None if slo_ttft_ms is None else slo_ttft_ms / 1000,
            release_concurrency=release_concurrency, cold_start_fallback_s=cold_start_fallback,
            inference_objectives=objectives, migration_limit=migration_limit, migration_wait_s=migration_wait,
            shutdown_delay_s=shutdown_delay, drain_timeout_s=drain_timeout,
            api_key=api_key, tenant_keys=tenant_keys,
            max_request_bytes=max_request_bytes, trust_gateway_headers=trust_gateway_headers,
            kv_events_port=kv_events_port,
            kv_events_endpoints=dict(_pair(e) for e in kv_events_endpoint),
            kv_events_stale_after_s=kv_events_stale_after,
            kv_tokenizer=kv_tokenizer,
            kv_block_size=kv_block_size,
            prefill_backends=tuple(prefill), decode_backends=tuple(decode), decode_policy=decode_policy,
            prefill_timeout_s=prefill_timeout, disaggregated=disaggregated,
            standby_wake=standby_wake, standby_wake_inflight=standby_wake_inflight,
            standby_wake_wait_s=standby_wake_wait,
            # The replicas take this key on POST /wake_up and nowhere else; the operator sets it from a Secret.
            wake_api_key=os.environ.get(WAKE_API_KEY_ENV) or None,
        )
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "options"
            typer.echo(f"plimsoll route: {where}: {error['msg']}", err=True)
        raise typer.Exit(code=2) from None
    os.environ.pop(API_KEY_ENV, None)  # read once; nothing the router starts needs it
    os.environ.pop(WAKE_API_KEY_ENV, None)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if otlp_traces_endpoint:
        from plimsoll.tracing import configure_tracing

        configure_tracing("plimsoll-route", otlp_traces_endpoint)
    app = build_app(config)
    server = DrainingRouter(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                       timeout_graceful_shutdown=int(config.drain_timeout_s)),
        app.state.router, shutdown_delay_s=config.shutdown_delay_s,
    )  # fmt: skip
    server.run()
