"""A torch.profiler trace of the engine loop, driven from the engine thread itself.

What it is: :class:`StepProfiler`, owned by ``AsyncEngine``. The engine thread
starts and stops it (``begin``/``end``, posted as engine commands, so the
profiler runs on the thread whose ops it records) and wraps every step in
:meth:`span`, a ``record_function("engine_step")`` while a trace is being taken
and nothing otherwise, so an unprofiled server pays no per-step cost.
What it is not: the HTTP endpoint, its limits or the trace export
(``serving/profiling.py``), nor a sampler of the whole process (py-spy does that).
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

STEP_SPAN = "engine_step"


class ProfileBusyError(RuntimeError):
    """A trace is already being taken; one at a time."""


class StepProfiler:
    """At most one torch.profiler session of the engine loop at a time."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._profile: Any = None

    @property
    def is_active(self) -> bool:
        return self._profile is not None

    def begin(self) -> None:
        """Start recording (on the engine thread); raises ProfileBusyError if already recording."""
        if self._profile is not None:
            raise ProfileBusyError("a torch profile of the engine loop is already being taken")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda") and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        profile.start()
        self._profile = profile

    def end(self) -> Any:
        """Stop recording (on the engine thread) and return the profile, ready to export anywhere."""
        profile, self._profile = self._profile, None
        if profile is None:
            raise RuntimeError("no torch profile is being taken")
        profile.stop()
        return profile

    def span(self) -> AbstractContextManager[Any]:
        """One ``engine_step`` span around a step while recording; a no-op otherwise."""
        if self._profile is None:
            return nullcontext()
        return torch.profiler.record_function(STEP_SPAN)
