"""Gateway API Inference Extension request headers: the tenant and the objective of a request.

What it is: the two header names the ecosystem uses (``x-gateway-inference-fairness-id``
names the tenant, ``x-gateway-inference-objective`` names an ``InferenceObjective``),
the parser of ``--inference-objective NAME=PRIORITY`` (shared by ``plimsoll serve`` and
``plimsoll route``), and the rule that turns a request's objective into the vLLM
``priority`` the scheduler reads.

Sign conventions differ, so this is the one place that converts: an InferenceObjective's
``spec.priority`` is *higher = more important* (GIE); vLLM's request ``priority`` is
*lower = served first*. An objective of priority P is served as vLLM priority ``-P``.

What it is not: a Kubernetes client (objectives are given on the command line, as the
operator renders them), or the scheduler (``runtime/engine/policy.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

# Every header of the Gateway API Inference Extension starts so; the router drops clients' copies.
GATEWAY_HEADER_PREFIX = "x-gateway-inference-"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# vLLM accepts a 32-bit signed priority; so do we, on both sides of the sign flip.
PRIORITY_MIN, PRIORITY_MAX = -(2**31) + 1, 2**31 - 1


def parse_objectives(specs: Iterable[str]) -> dict[str, int]:
    """``["interactive=10", "batch=-5"]`` -> ``{"interactive": -10, "batch": 5}`` (vLLM priorities).

    Raises ``ValueError`` saying which entry is wrong and how to write it.
    """
    objectives: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(
                f"--inference-objective {spec!r} is not NAME=PRIORITY; write e.g. "
                "--inference-objective interactive=10 (PRIORITY as in the InferenceObjective's spec.priority)"
            )
        try:
            priority = int(value.strip())
        except ValueError:
            raise ValueError(
                f"--inference-objective {spec!r}: priority {value!r} is not an integer; "
                "use the InferenceObjective's spec.priority, e.g. interactive=10"
            ) from None
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise ValueError(
                f"--inference-objective {spec!r}: priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]"
            )
        if name in objectives:
            raise ValueError(f"--inference-objective {name!r} is given twice; give each objective once")
        objectives[name] = -priority
    return objectives


def objective_priority(header: str | None, body_priority: int, objectives: dict[str, int]) -> int:
    """The vLLM priority of a request: its objective's when the header names one, else the body's.

    The objective wins over the body's ``priority``: the gateway (the platform's admin)
    sets the header, any client can set the body. Raises ``ValueError`` for an objective
    this server was not told about.
    """
    if header is None or header.strip() == "":
        return body_priority
    name = header.strip()
    if name not in objectives:
        known = ", ".join(sorted(objectives)) or "none"
        raise ValueError(
            f"{OBJECTIVE_HEADER} {name!r} names no InferenceObjective this server knows (known: {known}); "
            "send a known objective, or start the server with --inference-objective "
            f"{name}=PRIORITY"
        )
    return objectives[name]
