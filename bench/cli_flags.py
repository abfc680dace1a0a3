"""The flags the `plimsoll bench` commands share, declared once, and the decorator that adds them.

What it is: each shared flag as a :class:`Flag` (parameter name, type, typer option; :func:`flag`
builds the usual one, spelled ``--`` plus its parameter name with dashes),
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


def flag(name: str, annotation: Any, default: Any, help: str, *short: str, **more: Any) -> Flag:
    """A shared flag spelled ``--`` plus ``name`` with dashes (and any ``short`` spellings such as ``-o``)."""
    return Flag(
        name, annotation, typer.Option(default, "--" + name.replace("_", "-"), *short, help=help, **more)
    )


API_KEY = typer.Option(
    None, "--api-key", envvar="PLIMSOLL_API_KEY", help="Bearer token, if the server needs one"
)
LENGTH_HELP = "N, uniform:LO:HI, normal:MEAN:STD or choice:A,B"

SERVER = (
    flag("url", str, ..., "Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000"),
    flag("model", str | None, None, "Model id to request (default: the server's only model)"),
    Flag("api_key", str | None, API_KEY),
    flag("endpoint", str, "completions", "completions or chat"),
)
MODEL_MIX = (
    flag(
        "models",
        str | None,
        None,
        "Comma-separated model ids sent in an even mix (a base model and its LoRA adapters); "
        "the report adds per-model figures to each level",
    ),
)
SHAPE = (
    flag("input_tokens", str, "128", LENGTH_HELP),
    flag("output_tokens", str, "64", LENGTH_HELP),
)
SHARED_PREFIX = (
    flag("shared_prefix_tokens", int, 0, "Length of a prefix shared by a fraction of requests"),
    flag("shared_prefix_fraction", float, 0.0, "Fraction of requests using the shared prefix"),
)
LEVEL = (
    flag(
        "requests_per_level",
        int | None,
        None,
        "Measured requests per level, at least one per client (default: max(100, 4 × concurrency); "
        "with --duration-per-level, as many as fit)",
        show_default=False,
    ),
    flag("duration_per_level", float | None, None, "Measured seconds per level (after warm-up)"),
    flag("warmup_requests", int | None, None, "Completions excluded as warm-up (default: one per client)"),
    flag("repeats", int, 1, "Repeats per level"),
)
SLO_FLAGS = (
    flag("slo_ttft_p95_ms", float | None, None, "SLO: TTFT p95 in ms"),
    flag("slo_tpot_p50_ms", float | None, None, "SLO: TPOT p50 in ms"),
    flag("slo_e2e_p95_ms", float | None, None, "SLO: end-to-end p95 in ms"),
)
CLIENT = (
    flag("request_timeout", float, 120.0, "Seconds before a request counts as timed out"),
    Flag(
        "ignore_eos",
        bool,
        typer.Option(
            True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly max_tokens (vLLM extension)"
        ),
    ),
    flag("seed", int, 0, "Workload seed"),
    flag("max_client_lag_ms", float, 50.0, "Gate: client event-loop lag p99 above is invalid"),
    flag(
        "output", Path | None, None, "JSON report path; CSV, JSONL, PNG and HTML are written beside it", "-o"
    ),
)
GATES = (
    flag("max_error_rate", float, 0.01, "Gate: a level with more errors is invalid"),
    flag("min_concurrency_ratio", float, 0.95, "Gate: achieved/target concurrency below is invalid"),
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
