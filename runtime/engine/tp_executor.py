"""Tensor-parallel ranks of one replica: spawn the workers, broadcast each step's plan, watch them.

What it is: ``TensorParallelExecutor`` runs in the server process, which is rank 0
(the scheduler, the sampler and HTTP live only there). It starts ranks 1..N-1 with
``torch.multiprocessing`` (spawn) on a free 127.0.0.1 port, joins their process
group, and then broadcasts each step's ``StepPlan`` (token ids, positions, slot
mapping and block tables, all decided by rank 0's scheduler, so prefix caching,
preemption and speculative decoding need nothing from the workers). A worker
(``run_worker``) loads the same model, keeps its shard, allocates the KV cache of
its heads with rank 0's block count, and runs every plan it receives.

Failure: a watchdog thread waits on the workers' process sentinels; a worker that
exits unasked marks the executor failed and calls ``on_failure`` (the async engine
then fails every stream and the server drains and exits 1). A step that was inside
a collective when a peer died fails at once (gloo sees the closed socket) or at
``tensor_parallel_timeout_s``; a worker whose parent dies exits by itself.
What it is not: sharding (``models/tensor_parallel.py``) or collectives
(``distributed/group.py``).
"""

import logging
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from plimsoll.runtime.distributed.group import TensorParallelGroup
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.model_runner import ModelRunner, StepPlan, cpu_options
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.kernels.host_memory import keep_freed_memory

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a worker loads the whole checkpoint before keeping its shard
STOP_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or exited; the replica cannot run another step."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: str, rank: int) -> torch.device:
    """CUDA ranks take one GPU each (``cuda:rank``); CPU ranks share the host."""
    dev = torch.device(device)
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def threads_per_rank(tp: int) -> int:
    """The host's intra-op threads shared out over the ranks (they run at the same time)."""
    return max(1, torch.get_num_threads() // tp)


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        tp = config.tensor_parallel_size
        self.config = config
        self.tp = tp
        dev = torch.device(config.device)
        if dev.type == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs on this node, {torch.cuda.device_count()} "
                "are visible; lower --tensor-parallel-size or expose more GPUs"
            )
        backend = "nccl" if dev.type == "cuda" else "gloo"
        threads = threads_per_rank(tp) if dev.type == "cpu" else torch.get_num_threads()
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        port = _free_port()
        ctx = torch.multiprocessing.get_context("spawn")
        self.workers: list[Any] = []
        self._conns: list[Any] = []
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(rank, config.model_dump(), port, backend, threads, os.getpid(), child),
                name=f"plimsoll-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.workers.append(proc)
            self._conns.append(parent)
            log.info("tensor-parallel rank %d started: pid %d", rank, proc.pid)
        self.failure: TensorParallelError | None = None
        self.on_failure: Callable[[TensorParallelError], None] | None = None
        self._closing = False
        if dev.type == "cuda":
            torch.cuda.set_device(0)
        self.group = TensorParallelGroup.init(0, tp, port, backend, config.tensor_parallel_timeout_s)
        self._watchdog = threading.Thread(target=self._watch, name="plimsoll-tp-watchdog", daemon=True)
        self._watchdog.start()

    # -- start ----------------------------------------------------------------------------

    def start_workers(self, num_blocks: int) -> None:
        """Tell the workers the KV block count rank 0 chose, and wait until each has loaded."""
        try:
            self.broadcast_plan_or_stop(num_blocks)  # returns once every worker has loaded its shard
        except Exception as exc:
            raise TensorParallelError(
                f"a tensor-parallel worker failed to start: {self._startup_errors()}"
            ) from exc
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.2):
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} not ready after {READY_TIMEOUT_S}s"
                    )
            status, detail = conn.recv()
            if status != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def _startup_errors(self) -> str:
        found = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self.workers, strict=True), start=1):
            if conn.poll(1.0):
                _, detail = conn.recv()
                found.append(f"rank {rank}: {detail}")
            elif not proc.is_alive():
                found.append(f"rank {rank} exited with code {proc.exitcode}")
        return "; ".join(found) or "no worker said why"

    # -- steps ----------------------------------------------------------------------------

    def broadcast_plan(self, plan: StepPlan) -> None:
        """Rank 0's host plan, as built (no device round trip): each rank uploads its own copy."""
        self.broadcast_plan_or_stop(plan)

    def broadcast_plan_or_stop(self, plan: object) -> None:
        self._raise_if_failed()
        self.group.broadcast_plan(plan)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    # -- failure and shutdown ---------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {proc.sentinel: (rank, proc) for rank, proc in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(1.0)
        self.failure = TensorParallelError(
            f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
            "the replica cannot run without it"
        )
        log.error("%s", self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def close(self) -> None:
        """Stop the workers (a stop plan when they are healthy, then terminate) and leave the group."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None and all(p.is_alive() for p in self.workers):
            try:
                self.group.broadcast_plan(None)
            except Exception as exc:  # a worker died just now; it is killed below anyway
                log.warning("tensor-parallel stop broadcast failed: %r", exc)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.workers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        if self.failure is None:
            self.group.destroy()
        # After a failure, destroying would wait on the dead peer; the process is exiting anyway.


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)  # rank 0 is gone: nothing can drive this rank any more


def run_worker(
    rank: int, config_dict: dict[str, Any], port: int, backend: str, threads: int, parent_pid: int, conn: Any
) -> None:
    """A worker rank's whole life: join, load its shard, then run rank 0's plans until told to stop."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from plimsoll.runtime.models.loader import load_model

    torch.set_num_threads(threads)
    config = EngineConfig(**config_dict)
    if config.keep_freed_memory:
        keep_freed_memory()  # as rank 0's engine does
    device = rank_device(config.device, rank)
    if device.type == "cpu":
        cpu_kernels.select(config.cpu_kernels, config.cpu_kernel_parallel)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = TensorParallelGroup.init(
            rank, config.tensor_parallel_size, port, backend, config.tensor_parallel_timeout_s
        )
        loaded = load_model(config.model, config.torch_dtype, device, None, tensor_parallel=group)
        num_blocks = group.receive_plan()  # rank 0 sizes the cache; every rank's block tables are its
        assert isinstance(num_blocks, int)
        runner = ModelRunner(
            loaded.model, num_blocks, config.block_size, config.torch_dtype, device, config.attention_backend,
            kv_cache_dtype=config.kv_cache_dtype, cpu_options=cpu_options(config),
        )  # fmt: skip
        # As rank 0's warm-up does (LLMEngine.warmup): the matmul primitives every step shape needs.
        runner.model.prime_matmuls(config.max_num_batched_tokens, config.max_logit_rows)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc
    conn.send(("ready", None))
    while True:
        plan = group.receive_plan()
        if plan is None:
            break
        assert isinstance(plan, StepPlan)
        runner.inputs.begin_step()
        runner.run(runner.upload(plan))
    group.destroy()
    # Leave without the interpreter's teardown: C++ static destructors (gloo's, oneDNN's, the
    # OpenMP runtime's) running beside their still-live threads aborted one exit in many
    # ("terminate called without an active exception", exit code -6) after a clean stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
