"""How much of an accelerator the KV cache gets: the one rule `plimsoll serve` and `plimsoll plan` apply.

What it is: vLLM's ``--gpu-memory-utilization`` rule. A server may hold
``utilization × total`` of the device; everything it holds besides the KV cache comes
off first — the weights, the activations of the largest step it can take (with the
sampler's tensors and the CUDA graphs' memory pool), and what CUDA libraries hold
outside torch's allocator — and the KV cache gets the rest, in whole blocks.
``KVCacheBudget`` does that arithmetic and writes the start-up line (KV tokens, blocks,
the largest concurrency at ``max_model_len``, as vLLM logs them). The engine fills it
with figures it measured after loading, warming up the largest step and capturing its
graphs; ``plimsoll plan`` fills it with estimates (``activation_bytes_estimate``), so
both arrive at their KV figure the same way.

What it is not: a profiler (the engine measures, ``runtime/engine/kv_sizing.py``) or a
model of fragmentation.
"""

from dataclasses import dataclass

GiB = 2**30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# `plimsoll serve`'s defaults that the KV budget depends on (EngineConfig's; a test keeps them equal).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_BLOCK_SIZE = 16
# What CUDA libraries (cuBLAS workspaces, the Triton launcher, NCCL) hold outside torch's
# allocator once a server has run its largest step: an estimate for `plimsoll plan`; the
# engine measures its own.
NON_TORCH_BYTES_ESTIMATE = 256 * 2**20
# Float32 [rows, V] tensors the sampler holds at its peak (logits, their edited copy, the
# probabilities, their cumulative sum, a sort's values and int64 indices), per logits row.
SAMPLER_COPIES = 8


def gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB, where two decimals of GiB say nothing)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def activation_bytes_estimate(
    *,
    hidden: int,
    intermediate: int,
    q_dim: int,
    kv_dim: int,
    vocab: int,
    dtype_bytes: float,
    max_num_batched_tokens: int,
    max_logit_rows: int,
) -> int:
    """Peak activation bytes of one step of ``max_num_batched_tokens`` tokens (one layer at a
    time: residual and normed hidden states, q/k/v, attention output, the gated MLP's
    gate/up and activation) plus the sampler's float32 tensors for ``max_logit_rows`` rows and
    a penalty table per row (int32 counts and a bool per token). ``q_dim``, ``kv_dim`` and
    ``intermediate`` are per GPU with tensor parallelism."""
    tokens = max_num_batched_tokens
    layer = tokens * (2 * hidden + q_dim + 2 * kv_dim + q_dim + 3 * intermediate) * dtype_bytes
    sampler = max_logit_rows * vocab * (4 * SAMPLER_COPIES + 5)
    return int(layer + sampler)


@dataclass(frozen=True, slots=True)
class KVCacheBudget:
    """The KV cache's share of one device (one rank with tensor parallelism)."""

    total: int  # the device's memory
    utilization: float  # share of ``total`` this server may hold
    weights: int  # bytes the weights take there
    activations: int  # peak bytes above the weights: activations, sampler, CUDA graph pool
    non_torch: int  # bytes held outside torch's allocator
    bytes_per_token: int  # every KV cache's bytes per token (the target's and a draft model's)
    block_size: int

    @property
    def usable(self) -> int:
        return int(self.utilization * self.total)

    @property
    def non_kv(self) -> int:
        return self.weights + self.activations + self.non_torch

    @property
    def kv_bytes(self) -> int:
        """What is left for the KV cache (negative when the rest does not fit)."""
        return self.usable - self.non_kv

    @property
    def num_blocks(self) -> int:
        return max(self.kv_bytes, 0) // (self.bytes_per_token * self.block_size)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, max_model_len: int) -> float:
        """Sequences of ``max_model_len`` tokens the cache holds at once (vLLM's figure)."""
        return self.num_tokens / max_model_len

    def how(self) -> str:
        return (
            f"{self.utilization:g} × {gib(self.total)} − {gib(self.weights)} weights − "
            f"{gib(self.activations)} activations, sampler and CUDA graphs − {gib(self.non_torch)} outside torch"
        )

    def too_small(self, max_model_len: int) -> str | None:
        """Why this device cannot serve one sequence of ``max_model_len`` tokens (None: it can),
        in one line that says what to set."""
        if self.num_tokens >= max_model_len:
            return None
        need_blocks = -(-max_model_len // self.block_size)
        need = self.non_kv + need_blocks * self.block_size * self.bytes_per_token
        lowest = need / self.total
        fix = (
            f"raise --gpu-memory-utilization to at least {lowest:.2f}, or lower --max-model-len"
            if lowest <= 1.0
            else "lower --max-model-len, use --quantization int8 or --kv-cache-dtype int8, or a larger device"
        )
        return (
            f"this device is too small: {self.how()} leaves {gib(max(self.kv_bytes, 0))} for the KV cache, "
            f"{self.num_tokens} tokens, and one sequence of max_model_len {max_model_len} needs "
            f"{need_blocks * self.block_size} ({gib(need_blocks * self.block_size * self.bytes_per_token)}); {fix}"
        )


def kv_cache_line(kv_bytes: int, num_blocks: int, block_size: int, max_model_len: int, source: str) -> str:
    """The start-up line: KV bytes and where they came from, tokens, blocks, maximum concurrency."""
    tokens = num_blocks * block_size
    return (
        f"KV cache: {gib(kv_bytes)} ({source}): {tokens:,} tokens in {num_blocks:,} blocks of {block_size}; "
        f"maximum concurrency for {max_model_len:,} tokens per request: {tokens / max_model_len:.2f}x"
    )
