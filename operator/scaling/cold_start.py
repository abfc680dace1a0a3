"""Measured cold starts of one LLMService: from "a replica is needed" to "a replica is Ready".

What it is: :class:`ColdStartClock`, pure and clock-driven. The handler calls
:meth:`needed` when it scales from zero (or, for the very first start, with the
object's creation time) and :meth:`seen_ready` on every tick with the number of
ready replicas; the first Ready after a need closes one sample. The samples
(the last 20) and their p95 go to ``status.coldStart``, where the router reads
them for ``Retry-After`` and its hold deadline. The phases of the last cold
start (held → decided → Ready) are kept as they were seen.

What it is not: a reader of pods or a clock (the handler passes times in).
"""

import math
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.scaling.timestamps import rfc3339

KEPT = 20


def p95(samples: list[float]) -> float | None:
    """Nearest-rank 95th percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)] if ordered else None


@dataclass
class ColdStartClock:
    samples: list[float] = field(default_factory=list)
    needed_at: float | None = None
    held_for_s: float | None = None  # how long the oldest held request had waited at the decision
    last: dict[str, Any] | None = None

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> "ColdStartClock":
        samples = [float(s) for s in ((status or {}).get("samplesSeconds") or [])]
        return cls(samples=samples[-KEPT:], last=(status or {}).get("last"))

    def needed(self, at: float, held_for_s: float | None = None) -> None:
        if self.needed_at is None:
            self.needed_at, self.held_for_s = at, held_for_s

    def seen_ready(self, now: float, ready: int) -> bool:
        """Close the open cold start when a replica is Ready; True when a sample was added."""
        if self.needed_at is None or ready < 1:
            return False
        seconds = max(0.0, now - self.needed_at)
        self.samples = [*self.samples, round(seconds, 3)][-KEPT:]
        self.last = {
            "decidedAt": rfc3339(self.needed_at),
            "readyAt": rfc3339(now),
            "seconds": round(seconds, 3),
            "heldBeforeDecisionSeconds": self.held_for_s,
        }
        self.needed_at, self.held_for_s = None, None
        return True

    def to_status(self) -> dict[str, Any]:
        return {
            "samplesSeconds": list(self.samples),
            "p95Seconds": p95(self.samples),
            "inProgressSince": None if self.needed_at is None else rfc3339(self.needed_at),
            "last": self.last,
        }
