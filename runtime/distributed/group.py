"""The ranks of one tensor-parallel replica and the collectives they run.

What it is: ``TensorParallelGroup.init`` joins ``torch.distributed`` over TCP on a
given host and port (gloo on CPU, NCCL on CUDA for the data collectives), plus a
second, gloo-only group for the step plans rank 0 broadcasts (pickled CPU tensors,
as vLLM's ``cpu_group`` carries its metadata). The data collectives time out after
``timeout_s``, so a peer that hangs mid-forward ends the step with an error instead
of a hang; the plan group waits as long as the server stays idle, and a peer that
dies closes its sockets, which ends any wait at once. ``collective_seconds`` adds up
the time spent inside data collectives (the benchmark's all-reduce share): on CUDA the
GPU time between CUDA events recorded around each collective (NCCL returns as soon as the
work is queued, so the host's clock would time only the enqueue), read when asked; on CPU
the wall time of the call (gloo blocks until done).

What it is not: process management (``engine/tp_executor.py`` spawns and watches
the workers) or sharding (``models/tensor_parallel.py``).
"""

import time
from datetime import timedelta
from typing import Any

import torch
from torch import distributed as dist

# Plans wait for the next step, which comes when a request does: effectively forever.
PLAN_WAIT = timedelta(days=365)


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, plan_group: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.plan_group = plan_group
        self._seconds = 0.0  # time inside all_reduce / gather, this rank, resolved so far
        self._pending: list[tuple[Any, Any]] = []  # CUDA (start, end) events not read yet

    @property
    def collective_seconds(self) -> float:
        """Seconds this rank spent in data collectives (reading CUDA events waits for them)."""
        self._read_events(wait=True)
        return self._seconds

    def _read_events(self, wait: bool) -> None:
        """Add up the timed collectives whose end event has passed (all of them with ``wait``)."""
        still = []
        for start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                still.append((start, end))
                continue
            self._seconds += start.elapsed_time(end) / 1000.0
        self._pending = still

    def _timed(self, tensor: torch.Tensor, run: Any) -> Any:
        if tensor.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]  # torch.cuda.Event.__init__ is unannotated (torch 2.15)
            start.record()
            result = run()
            end.record()
            self._pending.append((start, end))
            if len(self._pending) > 1024:  # keep the list short on a server nobody asks (never waits)
                self._read_events(wait=False)
            return result
        t0 = time.perf_counter()
        result = run()
        self._seconds += time.perf_counter() - t0
        return result

    @classmethod
    def init(
        cls, rank: int, world_size: int, port: int, backend: str, timeout_s: float, host: str = "127.0.0.1"
    ) -> "TensorParallelGroup":
        """Join the replica's process group (blocks until every rank has joined)."""
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process; close the other "
                "tensor-parallel engine (LLMEngine.close()) before starting a new one"
            )
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        plan_group = dist.new_group(backend="gloo", timeout=PLAN_WAIT)
        return cls(rank, world_size, plan_group)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self._timed(tensor, lambda: dist.all_reduce(tensor))

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets every rank's ``tensor`` concatenated on the last dim; the others get theirs back."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first else None
        self._timed(tensor, lambda: dist.gather(tensor, parts, dst=0))
        return torch.cat(parts, dim=-1) if parts is not None else tensor

    def broadcast_plan(self, plan: object) -> None:
        """Rank 0: send one step's plan (any picklable object; ``None`` means stop)."""
        dist.broadcast_object_list([plan], src=0, group=self.plan_group)

    def receive_plan(self) -> object:
        """Worker ranks: wait for rank 0's next plan."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.plan_group)
        return box[0]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
