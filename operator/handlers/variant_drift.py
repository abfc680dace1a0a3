"""``ProfileDrift`` for a service with hardware variants: each variant's replicas against its own profile.

What it is: :class:`VariantDrift`, kept by the replica-planning loop beside the
single-shape :class:`~plimsoll.operator.handlers.drift.DriftState`. Each tick
every variant's Ready replicas are compared with that variant's profile
(``status.variants.<name>.capacity``) by a ``DriftState`` of its own; the one
condition says the first variant that drifts (its name leading the message),
else that every variant matches. The variant is returned with the verdict, so
the re-profile annotation names it and only that variant is measured again.

What it is not: the comparison (``operator/scaling/drift.py``) or the write.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.drift import DriftState, DriftUpdate
from plimsoll.operator.resources.variants import variant_service
from plimsoll.operator.scaling.observations import Observations


@dataclass
class VariantDrift:
    """One DriftState per variant."""

    states: dict[str, DriftState] = field(default_factory=dict)

    def check(
        self, svc: LLMService, status: dict[str, Any], obs: Observations, now: float
    ) -> tuple[DriftUpdate | None, str | None]:
        """What ProfileDrift should read now, and the variant it is about (None: every variant, or none)."""
        for gone in set(self.states) - {v.name for v in svc.spec.variants}:
            del self.states[gone]
        ready = obs.ready_samples()
        found: list[tuple[str, DriftUpdate]] = []
        for variant in svc.spec.variants:
            state = self.states.setdefault(variant.name, DriftState())
            own = ((status.get("variants") or {}).get(variant.name) or {}).get("capacity")
            view = {"capacity": own, "conditions": status.get("conditions")}
            samples = {
                p.name: ready[p.name] for p in obs.pods if p.variant == variant.name and p.name in ready
            }
            update = state.check(variant_service(svc, variant), view, samples, now)
            if update is not None:
                found.append((variant.name, update))
        drifting = [(n, u) for n, u in found if u.status == "True"]
        if drifting:
            name, update = drifting[0]
            return _named(update, name), name
        if found:
            name, update = found[0]
            return _named(update, name), None
        return None, None


def _named(update: DriftUpdate, variant: str) -> DriftUpdate:
    verdict = dataclasses.replace(update.verdict, message=f"variant {variant}: {update.verdict.message}")
    return dataclasses.replace(update, verdict=verdict)
