"""The flags the `plimsoll bench` commands share, declared once, and the decorator that adds them.

What it is: each shared flag as a :class:`Flag` (parameter name, type, typer option),
grouped as the commands use them (the server, the request shape, the level, the SLO,
the client and the validity gates), and :func:`with_flags`, which gives a command
those parameters in front of its own and hands their values over in one dict. What it
is not: validation (``cli.make_config`` turns the values into a ``BenchConfig``) or
the commands themselves (cli.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer


@dataclass(frozen=True)
class Flag:
    """One shared flag: the command parameter ``name`` of type ``annotation``, parsed by ``option``."""

    name: str
    annotation: Any
    option: Any  # a typer OptionInfo


API_KEY = typer.Option(
    None, "--api-key", envvar="PLIMSOLL_API_KEY", help="Bearer token, if the server needs one"
)

SERVER = (
    Flag(
        "url",
        str,
        typer.Option(
            ..., "--url", help="Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000"
        ),
    ),
    Flag(
        "model",
        str | None,
        typer.Option(None, "--model", help="Model id to request (default: the server's only model)"),
    ),
    Flag("api_key", str | None, API_KEY),
    Flag("endpoint", str, typer.Option("completions", "--endpoint", help="completions or chat")),
)
MODEL_MIX = (
    Flag(
        "models",
        str | None,
        typer.Option(
            None,
            "--models",
            help="Comma-separated model ids sent in an even mix (a base model and its LoRA adapters); "
            "the report adds per-model figures to each level",
        ),
    ),
)
SHAPE = (
    Flag(
        "input_tokens",
        str,
        typer.Option("128", "--input-tokens", help="N, uniform:LO:HI, normal:MEAN:STD or choice:A,B"),
    ),
    Flag(
        "output_tokens",
        str,
        typer.Option("64", "--output-tokens", help="N, uniform:LO:HI, normal:MEAN:STD or choice:A,B"),
    ),
)
SHARED_PREFIX = (
    Flag(
        "shared_prefix_tokens",
        int,
        typer.Option(0, "--shared-prefix-tokens", help="Length of a prefix shared by a fraction of requests"),
    ),
    Flag(
        "shared_prefix_fraction",
        float,
        typer.Option(0.0, "--shared-prefix-fraction", help="Fraction of requests using the shared prefix"),
    ),
)
LEVEL = (
    Flag(
        "requests_per_level",
        int | None,
        typer.Option(
            None,
            "--requests-per-level",
            help="Measured requests per level, at least one per client (default: max(100, 4 × concurrency); "
            "with --duration-per-level, as many as fit)",
            show_default=False,
        ),
    ),
    Flag(
        "duration_per_level",
        float | None,
        typer.Option(None, "--duration-per-level", help="Measured seconds per level (after warm-up)"),
    ),
    Flag(
        "warmup_requests",
        int | None,
        typer.Option(
            None, "--warmup-requests", help="Completions excluded as warm-up (default: one per client)"
        ),
    ),
    Flag("repeats", int, typer.Option(1, "--repeats", help="Repeats per level")),
)
SLO_FLAGS = (
    Flag(
        "slo_ttft_p95_ms", float | None, typer.Option(None, "--slo-ttft-p95-ms", help="SLO: TTFT p95 in ms")
    ),
    Flag(
        "slo_tpot_p50_ms", float | None, typer.Option(None, "--slo-tpot-p50-ms", help="SLO: TPOT p50 in ms")
    ),
    Flag(
        "slo_e2e_p95_ms",
        float | None,
        typer.Option(None, "--slo-e2e-p95-ms", help="SLO: end-to-end p95 in ms"),
    ),
)
CLIENT = (
    Flag(
        "request_timeout",
        float,
        typer.Option(120.0, "--request-timeout", help="Seconds before a request counts as timed out"),
    ),
    Flag(
        "ignore_eos",
        bool,
        typer.Option(
            True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly max_tokens (vLLM extension)"
        ),
    ),
    Flag("seed", int, typer.Option(0, "--seed", help="Workload seed")),
    Flag(
        "max_client_lag_ms",
        float,
        typer.Option(50.0, "--max-client-lag-ms", help="Gate: client event-loop lag p99 above is invalid"),
    ),
    Flag(
        "output",
        Path | None,
        typer.Option(
            None, "--output", "-o", help="JSON report path; CSV, JSONL, PNG and HTML are written beside it"
        ),
    ),
)
GATES = (
    Flag(
        "max_error_rate",
        float,
        typer.Option(0.01, "--max-error-rate", help="Gate: a level with more errors is invalid"),
    ),
    Flag(
        "min_concurrency_ratio",
        float,
        typer.Option(
            0.95, "--min-concurrency-ratio", help="Gate: achieved/target concurrency below is invalid"
        ),
    ),
)


def with_flags(*groups: tuple[Flag, ...]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the shared flags of ``groups`` before its own parameters.

    The command is written as ``def cmd(flags: dict[str, Any], <own parameters>)``; typer
    sees one signature with the shared flags and the command's own, and the command gets
    the shared values in ``flags`` (keyed by parameter name).
    """
    shared = [flag for group in groups for flag in group]

    def register(command: Callable[..., None]) -> Callable[..., None]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]  # after `flags`
        params = [
            inspect.Parameter(
                f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.option, annotation=f.annotation
            )
            for f in shared
        ] + own

        @functools.wraps(command)
        def run(**values: Any) -> None:
            command({f.name: values.pop(f.name) for f in shared}, **values)

        # inspect.signature (which typer reads) honours __signature__; typeshed does not declare it.
        run.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        return run

    return register
