"""Iteration-level (continuous) batching over the paged KV cache.

What it is: each step, decide how many tokens every request computes. One rule
covers prefill, chunked prefill, prefix hits and decode: a request closes the gap
between ``num_computed_tokens`` and the tokens it knows, within a per-step token
budget and a sequence cap. Running requests go first (oldest first); when blocks
run out the newest running request is preempted (blocks freed, recomputed later).
Waiting requests are admitted FCFS, only in steps that preempted nobody.

``policy="priority"`` (vLLM's ``--scheduling-policy priority``): the order of the
waiting queue, the preemption victim and who may displace whom come from
``policy.py`` (lower ``priority`` first, fair share across tenants within a class);
a waiting request of a strictly higher class preempts the lowest-class running one
when the sequence slots are full, and KV preemptions pick the lowest class too.

``policy="static"`` is the baseline continuous batching beats: a new batch is
admitted only once the running one has fully drained; admission stays open until
the batch is full (``max_num_seqs``) or nothing is waiting.

What it is not: the model run or sampling; pure Python, no tensors.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from plimsoll.runtime.engine.kv_cache_manager import KVCacheManager
from plimsoll.runtime.engine.lora_manager import LoRAManager, LoRARequest
from plimsoll.runtime.engine.policy import SchedulingPolicy, make_policy
from plimsoll.runtime.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    num_kv_allocation_failures: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)  # (slot, adapter) to copy first

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(eq=False, repr=False)
class Scheduler:
    kv: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "continuous"
    lora: LoRAManager | None = None
    order: SchedulingPolicy = field(init=False)
    waiting: deque[Request] = field(default_factory=deque, init=False)
    running: list[Request] = field(default_factory=list, init=False)
    requests: dict[str, Request] = field(default_factory=dict, init=False)
    total_preemptions: int = field(default=0, init=False)
    _static_admission_open: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        if self.policy not in ("continuous", "static", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'continuous', 'static' or 'priority', got {self.policy!r}"
            )
        self.order = make_policy(self.policy)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use; use a unique id")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.order.on_added(req, self.requests.values())

    def _admission_allowed(self) -> bool:
        if self.policy != "static":
            return True
        if not self.running:
            self._static_admission_open = True
        return self._static_admission_open

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        allowed = self._admission_allowed()
        if self.order.is_priority:
            self._displace_for_higher_classes(out)
        num_displaced = len(out.preempted)
        self.order.running_order(self.running)

        # Pass 1: running requests, oldest first (by class first under the priority policy).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            assert num_new > 0, f"running request {req.request_id} has nothing to compute"
            while not self.kv.allocate_slots(req, num_new):
                out.num_kv_allocation_failures += 1
                victim = self.order.victim(self.running)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted itself; ``i`` now indexes the next request
            self._record(req, num_new, out)
            budget -= num_new
            i += 1

        # Pass 2: waiting requests in the policy's order, only if the KV cache preempted nobody.
        if len(out.preempted) == num_displaced and allowed:
            if self.lora is not None:
                self.lora.begin_admission()
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                # A request whose adapter cannot get a slot waits; the ones behind it may go.
                admissible = (r for r in self.waiting if self.lora is None or self.lora.can_acquire(r))
                try:
                    req = self.order.select(admissible)
                except (StopIteration, ValueError):  # FCFS: next() on nothing; priority: min() of nothing
                    break
                hits, num_hit = self.kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_hit, budget)
                if not self.kv.allocate_slots(req, num_new, hits):
                    out.num_kv_allocation_failures += 1
                    break
                self.waiting.remove(req)
                if self.lora is not None:
                    self.lora.acquire(req)
                out.prefix_cache_queries += req.num_tokens
                # Tokens found in the KV tiers count apart (vLLM's external prefix cache hits).
                out.prefix_cache_hits += num_hit - self.kv.last_tier_tokens
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._record(req, num_new, out)
                budget -= num_new
            if self.policy == "static" and (not self.waiting or len(self.running) >= self.max_num_seqs):
                self._static_admission_open = False

        if self.lora is not None:
            out.lora_loads = self.lora.take_pending_loads()
        # Progress is booked now; the runner reads the pre-step value from the tuple.
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            self.order.on_scheduled(req, num_new)
        return out

    def _displace_for_higher_classes(self, out: SchedulerOutput) -> None:
        """Free sequence slots for waiting requests that outrank running ones (priority policy).

        Walks the waiting requests in the policy's order: each takes a free slot if
        there is one, else preempts the lowest-class running request below its own class.
        """
        free = self.max_num_seqs - len(self.running)
        for candidate in self.order.first(self.waiting, self.max_num_seqs):
            if free > 0:
                free -= 1
                continue
            victim = self.order.should_displace(candidate, self.running)
            if victim is None:
                return
            self._preempt(victim, out)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Known tokens still to compute, plus the proposals that fit (speculative decoding).

        Proposals ride only on a decode row (exactly one known token to compute) and are
        trimmed to the budget and to ``max_model_len``; trimmed ones are dropped.
        """
        known = req.num_tokens - req.num_computed_tokens
        if req.spec_token_ids:
            fits = min(budget - known, self.max_model_len - 1 - req.num_tokens) if known == 1 else 0
            del req.spec_token_ids[max(fits, 0) :]
        return min(known + len(req.spec_token_ids), budget)

    def _record(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        out.scheduled.append((req, num_new))
        # Tokens before the first sampled one are prefill (prompt, or recompute after preemption).
        num_prefill = max(0, min(num_new, req.num_tokens - 1 - req.num_computed_tokens))
        if req.num_new_output_tokens == 0:
            num_prefill = num_new
        out.num_prefill_tokens += num_prefill
        out.num_decode_tokens += num_new - num_prefill

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        if self.lora is not None:
            self.lora.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished and free its blocks at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        else:
            return
        self.kv.free(req)
        if self.lora is not None:
            self.lora.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req
