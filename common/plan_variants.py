"""``plimsoll plan-variants``: the hardware-variant mix for a demand, offline, from one bench report per variant.

What it is: the operator's arithmetic without a cluster. Each ``--variant
NAME=REPORT:COST[:MAX[:spot]]`` is read as the per-variant profile Job reads its
report (``read_profile``: per-replica concurrency, and the requests/s one replica
finishes there), becomes an :class:`~plimsoll.operator.scaling.variant_mix.Offer`,
and ``choose_mix`` — the optimiser the replica planner runs — picks the cheapest
replicas per variant that carry ``--target-rps`` under ``--max-spot-fraction``.
It prints each variant's capacity and cost, the chosen mix, what it costs per hour
and per 1000 requests at that demand, the runner-up and why it lost.

What it is not: the planner's timing (scale-ups first, drains, availability), or
a capacity plan from a model config (that is ``plimsoll plan``).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from plimsoll.operator.scaling.profile import read_profile_file
from plimsoll.operator.scaling.variant_mix import MixChoice, Offer, choose_mix

# A variant can have any number of replicas offline; the exact search is fine this far.
DEFAULT_MAX_REPLICAS = 16


class VariantPlanError(ValueError):
    """A --variant that cannot be read, said so the user can fix it."""


@dataclass(frozen=True, slots=True)
class VariantOffer:
    """One --variant: the offer and where its figures came from."""

    offer: Offer
    concurrency: float
    report: Path


def parse_variant(text: str) -> tuple[str, Path, float, int, bool]:
    """``NAME=REPORT:COST[:MAX[:spot]]`` -> (name, report, cost per hour, max replicas, spot)."""
    usage = "give --variant NAME=REPORT.json:COST_PER_HOUR[:MAX_REPLICAS[:spot]], e.g. l4=l4.json:1.0:8:spot"
    name, sep, rest = text.partition("=")
    parts = rest.split(":")
    if not sep or not name or len(parts) < 2 or len(parts) > 4:
        raise VariantPlanError(f"--variant {text!r}: {usage}")
    try:
        cost = float(parts[1])
        most = int(parts[2]) if len(parts) > 2 and parts[2] else DEFAULT_MAX_REPLICAS
    except ValueError:
        raise VariantPlanError(
            f"--variant {text!r}: cost must be a number and MAX an integer; {usage}"
        ) from None
    if len(parts) == 4 and parts[3] != "spot":
        raise VariantPlanError(f"--variant {text!r}: the fourth field can only be 'spot'; {usage}")
    if cost <= 0 or most < 1:
        raise VariantPlanError(f"--variant {text!r}: cost must be > 0 and MAX at least 1")
    return name, Path(parts[0]), cost, most, len(parts) == 4


def read_variant(text: str) -> VariantOffer:
    """One --variant, its report read as the per-variant profile is."""
    name, report, cost, most, spot = parse_variant(text)
    try:
        profile = read_profile_file(report)
    except ValueError as err:
        raise VariantPlanError(f"--variant {name}: {err}") from None
    rate = profile.requests_per_second()
    if not rate:
        raise VariantPlanError(
            f"--variant {name}: {report} has no latencies at its recommended concurrency "
            "(a `plimsoll bench sweep` report has them)"
        )
    offer = Offer(name, rate, cost, 0, most, spot)
    return VariantOffer(offer, float(profile.concurrency_per_replica), report)


def plan_mix(variants: list[VariantOffer], target_rps: float, max_spot_fraction: float) -> dict[str, Any]:
    """The mix for ``target_rps`` and its explanation, as printed (and as ``--json``)."""
    names = [v.offer.name for v in variants]
    if len(set(names)) != len(names):
        raise VariantPlanError(f"variant names must be unique, got {', '.join(names)}")
    choice: MixChoice = choose_mix([v.offer for v in variants], target_rps, max_spot_fraction)
    chosen = choice.chosen
    per_1k = chosen.cost_per_hour / (target_rps * 3.6) if target_rps > 0 else None
    return {
        "targetRps": target_rps,
        "maxSpotFraction": max_spot_fraction,
        "variants": [
            {
                "name": v.offer.name,
                "report": str(v.report),
                "concurrencyPerReplica": v.concurrency,
                "requestsPerSecondPerReplica": v.offer.capacity,
                "costPerHour": v.offer.cost_per_hour,
                "costPerRequestPerSecond": round(v.offer.cost_per_capacity, 6),
                "maxReplicas": v.offer.max_replicas,
                "spot": v.offer.spot,
            }
            for v in variants
        ],
        "chosen": {
            "replicas": chosen.as_dict(),
            "describe": chosen.describe(),
            "capacityRps": round(chosen.capacity, 6),
            "costPerHour": chosen.cost_per_hour,
            "costPer1kRequests": None if per_1k is None else round(per_1k, 6),
            "spotShare": round(chosen.spot_share, 4),
        },
        "shortfallRps": round(choice.shortfall, 6),
        "runnerUp": None
        if choice.runner_up is None
        else {
            "describe": choice.runner_up.describe(),
            "costPerHour": choice.runner_up.cost_per_hour,
            "whyNot": choice.why_not,
        },
    }


def render(plan: dict[str, Any]) -> str:
    lines = [
        f"Demand {plan['targetRps']:g} requests/s, at most {plan['maxSpotFraction']:.0%} of capacity on spot."
    ]
    for v in plan["variants"]:
        lines.append(
            f"  {v['name']}: {v['requestsPerSecondPerReplica']:.3g} requests/s per replica at concurrency "
            f"{v['concurrencyPerReplica']:g}, {v['costPerHour']:g}/h ({v['costPerRequestPerSecond']:.3g}/h per "
            f"request/s), up to {v['maxReplicas']}{', spot' if v['spot'] else ''}  [{v['report']}]"
        )
    chosen = plan["chosen"]
    cost = f"{chosen['costPerHour']:g}/h"
    if chosen["costPer1kRequests"] is not None:
        cost += f", {chosen['costPer1kRequests']:.4g} per 1000 requests at this demand"
    lines.append(f"Mix: {chosen['describe']}: carries {chosen['capacityRps']:.4g} requests/s, {cost}")
    if plan["shortfallRps"] > 0:
        lines.append(f"  {plan['shortfallRps']:.4g} requests/s more than every variant's maximum carries")
    runner = plan["runnerUp"]
    if runner is not None:
        lines.append(f"Runner-up: {runner['describe']}: {runner['whyNot']}")
    return "\n".join(lines)


def plan_variants(
    variant: Annotated[
        list[str],
        typer.Option(help="NAME=REPORT.json:COST_PER_HOUR[:MAX_REPLICAS[:spot]], one per hardware variant."),
    ],
    target_rps: Annotated[float, typer.Option(help="Requests per second to serve.")],
    max_spot_fraction: Annotated[
        float,
        typer.Option(min=0.0, max=1.0, help="At most this share of the mix's capacity on spot variants."),
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """The cheapest mix of hardware variants for a demand, from one bench report per variant."""
    if target_rps < 0:
        raise typer.BadParameter("must be at least 0", param_hint="--target-rps")
    try:
        plan = plan_mix([read_variant(v) for v in variant], target_rps, max_spot_fraction)
    except VariantPlanError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(plan, indent=2) if as_json else render(plan))
