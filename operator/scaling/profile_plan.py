"""The profiler's next step for one LLMService, decided from what exists (pure).

What it is: :func:`decide`, which looks at the spec, the spec hash the capacity
was measured on, the service's profile Jobs (as :class:`JobView`) and whether a
replica on the current spec is Ready, and returns a :class:`Plan`: start a Job,
record a finished one, delete obsolete ones, clear the re-profile annotation,
and which ``Profiled`` / ``ProfileStale`` conditions to set. The rules are in
the docstring of ``operator/handlers/profiling.py``.

What it is not: it reads nothing from the cluster and writes nothing; the
handler observes, calls :func:`decide` and carries the plan out.
"""

from dataclasses import dataclass, field
from typing import Literal

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate

REPROFILE_ANNOTATION = "plimsoll.dev/reprofile"

JobState = Literal["Running", "Succeeded", "Failed"]


@dataclass(frozen=True, slots=True)
class JobView:
    """What the decision needs to know about one profile Job."""

    name: str
    spec_hash: str
    state: JobState
    recorded: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """The next step for one LLMService; at most one of start/record is set."""

    conditions: tuple[ConditionUpdate, ...] = ()
    start: str | None = None  # why a Job starts (for the Event)
    record: str | None = None  # the finished Job whose outcome to record
    delete: tuple[str, ...] = ()
    clear_annotation: bool = False
    events: tuple[tuple[str, str], ...] = field(default=())  # (reason, message), Normal


def decide(
    svc: LLMService,
    current_hash: str,
    capacity_hash: str | None,
    jobs: list[JobView],
    has_ready_pod: bool,
) -> Plan:
    """The next profiling step for ``svc``, from what exists (pure; see the module docstring)."""
    requested = REPROFILE_ANNOTATION in svc.metadata.annotations
    capacity = svc.spec.capacity
    running = [j for j in jobs if j.state == "Running"]
    if capacity.mode == "Manual":
        message = (
            f"capacity.mode Manual: {capacity.concurrency_per_replica} concurrent requests per replica "
            "from the spec; no benchmark runs"
        )
        return Plan(
            conditions=(
                ("Profiled", "False", "ManualCapacity", message),
                ("ProfileStale", "False", "ManualCapacity", "no profile is used in Manual mode"),
            ),
            delete=tuple(j.name for j in running),
            clear_annotation=requested,
        )

    obsolete = tuple(j.name for j in running if j.spec_hash != current_hash)
    stale = capacity_hash is not None and capacity_hash != current_hash
    if stale:
        how = (
            "re-profiling automatically (capacity.reprofile Auto)"
            if capacity.reprofile == "Auto"
            else f"annotate the LLMService with {REPROFILE_ANNOTATION}=<anything> to re-measure"
        )
        stale_condition: ConditionUpdate = (
            "ProfileStale", "True", "SpecChanged",
            f"the capacity was measured on spec {capacity_hash}, the spec is now {current_hash}; {how}",
        )  # fmt: skip
    elif capacity_hash is None:
        stale_condition = ("ProfileStale", "False", "NotProfiled", "no capacity has been measured yet")
    else:
        stale_condition = (
            "ProfileStale",
            "False",
            "ProfileCurrent",
            f"measured on the current spec {current_hash}",
        )

    job = next((j for j in jobs if j.spec_hash == current_hash), None)
    if job is not None and job.state == "Running":
        return Plan(
            conditions=(
                ("Profiled", "False", "Profiling", f"benchmark Job {job.name} is measuring one replica"),
                stale_condition,
            ),
            delete=obsolete,
            clear_annotation=requested,  # the Job it asked for is running
        )
    if job is not None and not job.recorded:
        # Recording writes both conditions itself, from the Job it reads.
        return Plan(record=job.name, delete=obsolete)

    if requested:
        why = f"annotation {REPROFILE_ANNOTATION}"
    elif job is not None:
        # A recorded Job for this spec: success is in status, a failure waits for the back-off.
        return Plan(conditions=(stale_condition,), delete=obsolete)
    elif capacity_hash == current_hash:
        return Plan(conditions=(stale_condition,), delete=obsolete)
    elif capacity_hash is None:
        why = "no capacity measured yet"
    elif capacity.reprofile == "Auto":
        why = "the profile is stale (engine, model, image or GPU changed)"
    else:
        return Plan(conditions=(stale_condition,), delete=obsolete)

    if not has_ready_pod:
        waiting: tuple[ConditionUpdate, ...] = (stale_condition,)
        if capacity_hash is None:
            waiting = (
                ("Profiled", "False", "WaitingForReplica", "profiling starts once a replica on the current spec is Ready"),
                stale_condition,
            )  # fmt: skip
        return Plan(conditions=waiting, delete=obsolete)
    return Plan(
        conditions=(("Profiled", "False", "Profiling", f"starting a benchmark Job ({why})"), stale_condition),
        start=why,
        delete=tuple(sorted({*obsolete, *(j.name for j in jobs if j.spec_hash == current_hash)})),
        clear_annotation=requested,
    )
