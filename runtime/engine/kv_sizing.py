"""Sizing the KV cache from what the device reports (vLLM's ``--gpu-memory-utilization``).

What it is: ``DeviceMemory``, the few memory figures the engine reads from its device
(``CudaMemory`` reads ``torch.cuda``; tests pass a fake with chosen figures), and the
three moments the engine reads them: ``start`` before loading (is ``utilization ×
total`` free at all?), after the weights, and ``measure`` after the engine has run its
largest step, sampled its largest batch and captured its CUDA graphs over a
provisional cache. ``measure`` turns those figures into the ``KVCacheBudget`` that
``plimsoll plan`` also uses (``plimsoll.kv_memory``): peak reserved bytes less the
weights and the provisional cache are the activations and workspaces; bytes the
device lost beyond what torch reserved are memory outside torch.

``profile_sampler`` runs the sampler's largest batch for the profile; ``estimated_budget``
is the rule with ``plimsoll plan``'s activation estimate, for tensor-parallel ranks, which
are not profiled.

What it is not: the largest step or the reallocation (``llm_engine.py``), or anything on
a CPU, where the cache size is explicit.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from plimsoll.kv_memory import NON_TORCH_BYTES_ESTIMATE, GiB, KVCacheBudget, activation_bytes_estimate
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampler import Sampler
from plimsoll.runtime.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from plimsoll.runtime.models.tensor_parallel import kv_heads_per_rank


class DeviceMemory(Protocol):
    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes of the whole device
    def memory_reserved(self) -> int: ...  # bytes torch's caching allocator holds now
    def max_memory_reserved(self) -> int: ...  # its peak since the last reset
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...


class CudaMemory:
    """``DeviceMemory`` of one CUDA device, from ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def max_memory_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass(frozen=True, slots=True)
class Baseline:
    """The device before this engine loaded anything."""

    free: int
    total: int
    reserved: int  # torch's own reservation then (0 in a fresh process)


def start(memory: DeviceMemory, utilization: float) -> Baseline:
    """Read the device before loading; refuse, in one line, when ``utilization × total`` is not free
    (vLLM's rule: the share is this server's, whatever else runs on the device)."""
    memory.synchronize()
    free, total = memory.mem_get_info()
    if free < utilization * total:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} asks for {utilization * total / GiB:.2f} GiB of this "
            f"device's {total / GiB:.2f} GiB, but only {free / GiB:.2f} GiB is free (another process holds "
            f"the rest); lower --gpu-memory-utilization to {max(free / total - 0.01, 0.0):.2f} or free the device"
        )
    return Baseline(free, total, memory.memory_reserved())


def measure(
    memory: DeviceMemory,
    baseline: Baseline,
    utilization: float,
    weights: int,
    provisional_kv: int,
    bytes_per_token: int,
    block_size: int,
) -> KVCacheBudget:
    """The KV budget after the profiling run. ``weights`` are the bytes torch reserved for the
    weights (read right after loading, less the baseline); ``provisional_kv`` the bytes of the
    caches the profiling run used, which the real cache replaces."""
    memory.synchronize()
    peak = memory.max_memory_reserved() - baseline.reserved
    reserved = memory.memory_reserved() - baseline.reserved
    free, total = memory.mem_get_info()
    non_torch = max(0, (baseline.free - free) - reserved)
    return KVCacheBudget(
        total=total,
        utilization=utilization,
        weights=weights,
        activations=max(0, peak - weights - provisional_kv),
        non_torch=non_torch,
        bytes_per_token=bytes_per_token,
        block_size=block_size,
    )


def profile_blocks(largest_step: int, block_size: int) -> int:
    """Blocks of the provisional cache: the profiling run's one request of ``largest_step`` tokens."""
    return -(-(largest_step + 1) // block_size) + 1


def profile_sampler(sampler: Sampler, rows: int, vocab_size: int, device: torch.device) -> None:
    """Sample the most rows a step can have with every stage on (the penalties' tables, a sort for
    top-p, logprobs), so their peak is in the profile; the rows leave nothing behind."""
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1, logprobs=MAX_LOGPROBS
    )
    reqs = [Request(f"__profile_{i}", "__profile__", 0, [0], params, frozenset()) for i in range(rows)]
    sampler(reqs, torch.zeros(rows, vocab_size, device=device))
    for req in reqs:
        sampler.release(req.request_id)


def estimated_budget(
    config: EngineConfig, hf_config: object, total: int, weights: int, bytes_per_token: int
) -> KVCacheBudget:
    """The rule with measured ``weights`` and the activations and outside-torch memory estimated as
    ``plimsoll plan`` estimates them (per rank with tensor parallelism)."""
    cfg: Any = hf_config
    tp = config.tensor_parallel_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    activations = activation_bytes_estimate(
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size // tp,
        q_dim=cfg.num_attention_heads * head_dim // tp,
        kv_dim=kv_heads_per_rank(cfg, tp) * head_dim,
        vocab=int(cfg.vocab_size),
        dtype_bytes=torch.empty((), dtype=config.torch_dtype).element_size(),
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_logit_rows=config.max_logit_rows,
    )
    return KVCacheBudget(
        total=total,
        utilization=config.gpu_memory_utilization,
        weights=weights,
        activations=int(activations),
        non_torch=NON_TORCH_BYTES_ESTIMATE,
        bytes_per_token=bytes_per_token,
        block_size=config.block_size,
    )
