"""When an LLMService with ``scaling.min: 0`` goes to zero replicas, and when it comes back.

What it is: :class:`IdleClock`, a pure, clock-driven record of the last time any
sign of work was seen — a replica with requests in flight, a replica whose
count of first tokens moved since the previous scrape (a request started and
finished between two ticks), or requests held by the router — and the rule
that the replicas go to zero once nothing was seen for ``scaling.idleSeconds``;
:func:`wake_replicas`, the count a held request brings back (``max(1, min)``);
and :func:`floored`, the autoscaler configuration with its floor at one replica
(the HPA formula on an idle service says 0, but going to zero is this module's
decision, after the idle window, not the formula's after the scale-down window).

What it is not: the drain before the last replica goes (``drain.py``), or any
I/O (the handler scrapes the pods and the router's ``/hold``).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from plimsoll.operator.scaling.autoscaler import AutoscalerConfig
from plimsoll.operator.scaling.metrics import PodSample


def floored(config: AutoscalerConfig) -> AutoscalerConfig:
    """The built-in autoscaler never goes below one replica by itself; zero is the idle rule's."""
    if config.min_replicas >= 1:
        return config
    return config.model_copy(update={"min_replicas": 1})


def wake_replicas(min_replicas: int) -> int:
    """Replicas a held request brings up from zero."""
    return max(1, min_replicas)


def _first_tokens(sample: PodSample) -> float:
    return sample.ttft.count if sample.ttft is not None else 0.0


@dataclass
class IdleClock:
    """The last moment work was seen; ``idle_for`` is how long ago that was."""

    last_activity: float
    _tokens: dict[str, float] = field(default_factory=dict)
    last_sign: str = "started"

    def observe(self, now: float, samples: Mapping[str, PodSample], held: int) -> None:
        """One tick's evidence: pods' scrapes (by pod name) and the router's held requests."""
        sign = ""
        if held > 0:
            sign = f"{held} request(s) held by the router"
        for name, sample in samples.items():
            tokens = _first_tokens(sample)
            if sample.in_flight > 0:
                sign = sign or f"{sample.in_flight:g} request(s) in flight on {name}"
            elif name in self._tokens and tokens != self._tokens[name]:
                sign = sign or f"requests finished on {name} since the last scrape"
            self._tokens[name] = tokens
        for gone in set(self._tokens) - set(samples):
            del self._tokens[gone]
        if sign:
            self.last_activity = max(self.last_activity, now)
            self.last_sign = sign

    def idle_for(self, now: float) -> float:
        return max(0.0, now - self.last_activity)

    def should_scale_to_zero(self, now: float, idle_seconds: float) -> bool:
        return self.idle_for(now) >= idle_seconds
