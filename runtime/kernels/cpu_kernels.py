"""The compiled CPU kernels as torch-shaped calls, over the one build this process runs.

What it is: functions with torch-shaped signatures over the C calls of ``csrc/``
(``plimsoll_kernels.h``), each checking its tensors before it hands their addresses over:
- attention (``csrc/attention.cpp``): ``decode_attention``, the contract of
  ``sdpa.decode_attention`` (one query per sequence over its paged context, K and V read
  straight from their blocks, where torch's path first gathers every context into a padded
  copy), and ``paged_attention``, the whole ragged contract (prefill, later chunks,
  prefix-cache hits, decode rows; float32 or bfloat16 cache, head_dim 64 or 128) in tiles of
  up to 8 queries of one sequence.
- matmuls (``csrc/matmul.cpp``): ``small_batch_linear`` (``x @ W.T + b`` for a few float32
  rows, where torch's libraries stream W at well under the memory bandwidth),
  ``bf16_linear`` (the same against bfloat16 weights), ``int8_linear`` (int8 weights with a
  scale and an offset per group of inputs, ``models/quant.py``), and ``pack_f32`` /
  ``packed_linear`` (a float32 weight packed once into column panels, then ``x @ W.T`` for any
  number of rows as outer products in register blocks: 0.75-0.95 of the FMA units' peak from
  16 rows on, where oneDNN and the plain-row kernel reach 0.55-0.9).
- the glue between a layer's matmuls (``csrc/glue.cpp``): ``add_rms_norm``, ``rope_store``,
  ``silu_mul``, ``to_bf16``, float32 or for a bfloat16 model.
- ``fused_decode`` (``csrc/decode_step.cpp``): every layer of a plain Llama decode step for a
  few rows in one call, over plain or packed float32 weights or int8 ones.
Which rows go where is the engine's CPU plan's (``models/cpu_plan.py``), not these functions'.

The build: ``setup.py`` compiles the kernels at install for AVX-512, AVX2 and plain x86-64
(``cpu_variants.py``); ``select`` makes one of them (or none) the process's kernels and
``library()`` returns it, loaded by ``cpu_library.py``. The engine selects at load, from
``--cpu-kernels`` (default ``auto``: the best build this CPU runs); a process that calls a
kernel before any engine did gets ``auto``. One build serves a whole process: the kernels
hold process-wide state (their worker pool, how calls split over threads). Where no build
loads, ``library()`` is ``None``, ``unavailable_reason()`` says why, and every caller keeps
torch's path: slower, never broken. ctypes releases the GIL during each call.
The kernels split a call's work as parallel regions on torch's own OpenMP team where torch's
runtime is GNU libgomp (``cpu_library.py``), so oneDNN's matmuls and the kernels between them
share one set of workers; elsewhere, and in a forked child, over a pool of threads started
once per process (``pool_threads``, ``pool_noop``), safe across fork and with several callers.

What it is not: bf16/fp16 arithmetic (bf16 is read and written, computed in float32), a
compiler (nothing is built at run time), or a GPU kernel (those stay in ``attention/sdpa.py``
and ``attention/triton_backend.py``).
"""

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch

from plimsoll.runtime.kernels import cpu_library
from plimsoll.runtime.kernels.cpu_library import KernelLibrary, KernelsUnavailable

log = logging.getLogger(__name__)

CHOICES = ("auto", "avx512", "avx2", "plain", "off")  # --cpu-kernels
PARALLEL_MODES = ("threads", "pool", "openmp")  # the kernels' Mode values, in order
# The attention kernels' cache_dtype argument: what the paged cache holds (csrc/attention.cpp).
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


@dataclass(frozen=True)
class Selection:
    """The process's kernels: the build in use (``None``: none) and, when none, why."""

    choice: str
    library: KernelLibrary | None
    reason: str | None


_selection: Selection | None = None


def select(choice: str = "auto", parallel: str = "auto") -> Selection:
    """Make ``choice`` (one of ``CHOICES``) the process's kernels and ``parallel`` (``auto`` or one
    of ``PARALLEL_MODES``) how their calls split over threads. ``auto``: the best build this CPU
    runs and loads; a build named outright is that one or none (the reason kept for the start-up
    line); ``off``: none."""
    global _selection
    if choice not in CHOICES:
        raise ValueError(f"cpu kernels {choice!r}: choose one of {', '.join(CHOICES)}")
    lib, reason = None, None
    if choice == "off":
        reason = "off (--cpu-kernels off)"
    else:
        names = [v.name for v in cpu_library.best_variants()] if choice == "auto" else [choice]
        reasons = []
        for name in names:
            try:
                lib = cpu_library.load(name)
                break
            except KernelsUnavailable as exc:
                reasons.append(str(exc))
        if lib is None:
            reason = "; ".join(reasons) or "no build runs on this CPU"
    if lib is not None:
        _set_parallel(lib, parallel)
    _selection = Selection(choice, lib, reason)
    return _selection


def _set_parallel(lib: KernelLibrary, mode: str) -> None:
    default = PARALLEL_MODES.index("openmp" if lib.openmp else "pool")
    wanted = default if mode == "auto" else PARALLEL_MODES.index(mode) if mode in PARALLEL_MODES else -1
    if wanted < 0 or lib.plimsoll_parallel_mode(wanted) < 0:
        log.warning("CPU kernels: parallel mode %r is not one this process runs (%s); kept %s",
                    mode, "/".join(PARALLEL_MODES), PARALLEL_MODES[default])  # fmt: skip
        lib.plimsoll_parallel_mode(default)


def selection() -> Selection:
    """The process's kernels (``auto`` if nothing selected them yet)."""
    return _selection if _selection is not None else select()


def library() -> KernelLibrary | None:
    """The build this process runs, or ``None`` (see ``unavailable_reason``)."""
    return selection().library


def unavailable_reason() -> str | None:
    """Why :func:`library` is ``None``, or ``None`` when it is not."""
    return selection().reason


def set_pool_enabled(on: bool) -> None:
    """Off: every kernel call starts and joins its own threads, as before the pool (for A/B timing only)."""
    lib = library()
    if lib is not None:
        lib.plimsoll_pool_enable(int(on))


def parallel_mode(mode: str | None = None) -> str:
    """How the kernels split a call over threads: ``"openmp"`` (a parallel region on torch's
    own OpenMP team, the default where torch's runtime is libgomp.so.1), ``"pool"`` (helper
    threads of their own) or ``"threads"`` (threads started per call, for A/B timing only).
    With ``mode``, switch to it first (ValueError where this process cannot); returns the mode
    now in force."""
    lib = _library_or_raise()
    if mode is not None and (mode not in PARALLEL_MODES or lib.plimsoll_parallel_mode(PARALLEL_MODES.index(mode)) < 0):
        raise ValueError(f"parallel mode {mode!r}: this build runs {sorted(available_parallel_modes())}")
    return PARALLEL_MODES[int(lib.plimsoll_parallel_mode_get())]


def available_parallel_modes() -> set[str]:
    """The modes :func:`parallel_mode` accepts in this process."""
    lib = _library_or_raise()
    now = int(lib.plimsoll_parallel_mode_get())
    ok = {m for i, m in enumerate(PARALLEL_MODES) if lib.plimsoll_parallel_mode(i) >= 0}
    lib.plimsoll_parallel_mode(now)
    return ok


def pool_threads() -> int:
    """Helper threads the kernels' worker pool has started in this process (0 before the first
    call that splits its work, or where the kernels are not built)."""
    lib = library()
    return 0 if lib is None else int(lib.plimsoll_pool_threads())


def pool_noop(tasks: int, use_pool: bool = True) -> int:
    """Run ``tasks`` empty tasks over the worker pool (or, ``use_pool=False``, over threads
    started for the call, as the kernels did before the pool); returns how many ran.
    What a call costs before any work: ``benchmarks/step_ab.py --compare pool`` times it."""
    lib = _library_or_raise()
    return int(lib.plimsoll_pool_noop(tasks, int(use_pool)))


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def supports_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` can take these tensors (and the kernels are built): a float32
    query over a float32, an int8 (``attention/kv_int8.py``) or a bfloat16 cache on CPU, or a
    bfloat16 query over a bfloat16 cache (a ``--dtype bfloat16`` engine's)."""
    return (
        query.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype
        and (
            (query.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.int8, torch.bfloat16))
            or (query.dtype == k_cache.dtype == torch.bfloat16)
        )
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and library() is not None
    )


def supports_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``small_batch_linear`` can take this matmul (float32 rows on CPU, kernels loaded);
    up to how many rows it should is the CPU plan's (``cpu_plan.RowLimits.small_matmul``)."""
    return (
        x.dim() == 2
        and x.shape[0] > 0
        and _float32_cpu(x, weight, *(() if bias is None else (bias,)))
        and weight.is_contiguous()
        and library() is not None
    )


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` and ``weight`` ``[N, K]``; returns ``[M, N]``."""
    lib = _library_or_raise("supports_linear")
    x, m, n, k = _matmul_operands(x, weight)
    out = torch.empty((m, n), dtype=x.dtype)
    bias_ptr = None if bias is None else bias.contiguous().data_ptr()
    rc = lib.plimsoll_small_batch_linear_f32(
        x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), m, n, k, torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(
            f"small_batch_linear rejected shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    return out


INT8_LANES = 16  # the kernel dequantises 16 weights at a time: a group must be a multiple


def int8_weight_fits(qweight: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """Whether the int8 kernels read this weight: contiguous int8 rows on CPU whose scale groups
    are a multiple of 16 inputs (``int8_linear`` and the fused decode step)."""
    groups = 1 if scales is None or scales.dim() < 2 else scales.shape[-1]
    return (
        qweight.dtype == torch.int8
        and qweight.device.type == "cpu"
        and qweight.dim() == 2
        and qweight.is_contiguous()
        and qweight.shape[1] % groups == 0
        and (qweight.shape[1] // groups) % INT8_LANES == 0
    )


def supports_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """Whether ``int8_linear`` can take this matmul (float32 rows on CPU, a weight it reads, built)."""
    return (
        x.dim() == 2
        and x.shape[0] > 0
        and _float32_cpu(x)
        and int8_weight_fits(qweight, scales)
        and library() is not None
    )


def int8_linear(
    x: torch.Tensor,  # [M, K] float32
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N, K // G] float32, one per group of G inputs ([N]: G = K)
    bias: torch.Tensor | None,
    offsets: torch.Tensor | None = None,  # [N, K // G] float32: w = scale * q + offset
) -> torch.Tensor:  # [M, N]
    """``x @ dequantize(qweight, scales, offsets).T + bias`` without materialising the float weight."""
    lib = _library_or_raise("supports_int8_linear")
    x, m, n, k = _matmul_operands(x, qweight)
    scales = scales.to(torch.float32).reshape(n, -1).contiguous()
    groups = scales.shape[1]
    if k % groups != 0 or (k // groups) % INT8_LANES != 0:
        raise ValueError(
            f"{groups} scale groups per row must divide the weight's {k} columns into groups of a "
            f"multiple of {INT8_LANES}"
        )
    if offsets is not None:
        offsets = offsets.to(torch.float32).reshape(n, -1).contiguous()
        if offsets.shape != scales.shape:
            raise ValueError(
                f"offsets {tuple(offsets.shape)} must have the scales' shape {tuple(scales.shape)}"
            )
    out = torch.empty((m, n), dtype=torch.float32)
    bias_ptr = None if bias is None else bias.to(torch.float32).contiguous().data_ptr()
    offset_ptr = None if offsets is None else offsets.data_ptr()
    rc = lib.plimsoll_int8_linear_f32(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), offset_ptr, bias_ptr, out.data_ptr(), m, n, k,
        k // groups, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"int8_linear rejected shapes x {tuple(x.shape)}, weight {tuple(qweight.shape)}")
    return out


def decode_attention(
    query: torch.Tensor,  # [B, H, D], one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 or bfloat16, or [.., D + 4] int8
    v_cache: torch.Tensor,  # (int8: each block its values, then its scales; attention/kv_int8.py)
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D] contiguous float32 to write into (default: a new one)
) -> torch.Tensor:  # [B, H, D]
    lib = _library_or_raise("supports_attention")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, row = k_cache.shape
    int8 = k_cache.dtype == torch.int8
    if row != (head_dim + 4 if int8 else head_dim):
        raise ValueError(f"the cache's rows hold {row} elements for a head_dim of {head_dim}")
    if int8 and head_dim % 4:  # the block's float32 scales start right after its values
        raise ValueError(f"an int8 cache needs head_dim divisible by 4, got {head_dim}")
    if query.dtype == torch.bfloat16:  # the kernel reads a float32 query and writes float32
        if out is not None:
            raise ValueError("a bfloat16 query's attention is returned, not written into out")
        return decode_attention(query.float(), k_cache, v_cache, block_tables, context_lens, scale).to(query.dtype)
    q = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = _output_for(q, out)
    rc = lib.plimsoll_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        CACHE_DTYPES.get(k_cache.dtype, 0),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"CPU decode attention rejected its inputs (code {rc}): heads {num_heads}/{num_kv_heads}, "
            f"block_size {block_size}, context lengths must be 1..{tables.shape[1] * block_size}"
        )
    return out


def _output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to be a contiguous float32 tensor of ``q``'s shape, or a new one."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out


def supports_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` can take these tensors: a float32 query over a contiguous
    float32 or bfloat16 cache on CPU with a head_dim of 64 or 128, and the kernels built."""
    return (
        supports_attention(query, k_cache, v_cache)
        and query.dtype == torch.float32
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and query.dim() == 3
        and query.shape[2] in (64, 128)
        and k_cache.shape[-1] == query.shape[2]
    )


def paged_attention(
    query: torch.Tensor,  # [N, H, D], the queries of all sequences packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 or bfloat16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    out: torch.Tensor | None = None,  # [N, H, D] contiguous float32 to write into (default: a new one)
) -> torch.Tensor:  # [N, H, D]
    """The whole contract of ``reference.paged_attention``: sequence b's queries are the last
    ``q_len`` positions of its ``context_lens[b]`` tokens (already stored), causal; prefills,
    later chunks, prefix-cache hits and decode rows in one call. Check
    ``supports_paged_attention`` first."""
    lib = _library_or_raise()
    q = query.contiguous()
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if cu.shape[0] != lens.shape[0] + 1 or tables.shape[0] != lens.shape[0] or int(cu[-1]) != num_rows:
        raise ValueError(
            f"paged_attention: {lens.shape[0]} sequences need {lens.shape[0] + 1} query offsets ending at "
            f"{num_rows} rows and a block table each; got {cu.shape[0]} offsets, {tables.shape[0]} tables"
        )
    out = _output_for(q, out)
    rc = lib.plimsoll_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), cu.data_ptr(), lens.data_ptr(),
        out.data_ptr(), lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, tables.shape[1], scale,
        CACHE_DTYPES.get(k_cache.dtype, 0), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"CPU paged attention rejected its inputs (code {rc}): heads {num_heads}/{num_kv_heads}, head_dim "
            f"{head_dim} (64 or 128), each sequence's queries at most its context of 1..{tables.shape[1] * block_size}"
        )
    return out


def supports_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``bf16_linear`` can take this matmul: rows of bfloat16 ``x`` against a contiguous
    bfloat16 ``weight`` whose inputs are a multiple of 16, on CPU, kernels loaded (up to how many
    rows it should: ``cpu_plan.RowLimits.bf16_matmul``)."""
    return (
        x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[0] > 0
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
        and x.shape[1] == weight.shape[1]
        and (bias is None or bias.shape == (weight.shape[0],))
        and library() is not None
    )


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in bfloat16 for a few rows (float32 sums, rounded once at the end)."""
    lib = _library_or_raise()
    if not supports_bf16_linear(x, weight, bias):
        raise ValueError(
            f"bf16_linear takes bfloat16 rows against a contiguous bfloat16 weight "
            f"of a multiple of 16 inputs; got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    xf = x.float().contiguous()
    bf = None if bias is None else bias.float().contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    rc = lib.plimsoll_bf16_linear_f32(
        xf.data_ptr(), weight.data_ptr(), None if bf is None else bf.data_ptr(), y.data_ptr(), x.shape[0],
        weight.shape[0], weight.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"bf16_linear rejected {tuple(x.shape)} @ {tuple(weight.shape)}")
    return y.to(torch.bfloat16)


def _library_or_raise(check: str | None = None) -> KernelLibrary:
    """The loaded kernels, or a RuntimeError that names the ``check`` the caller should have made
    first (or, without one, why the kernels are not available)."""
    lib = library()
    if lib is None:
        why = f"; check {check}() first" if check else f": {unavailable_reason()}"
        raise RuntimeError(f"the CPU kernels are not available{why}")
    return lib


def _matmul_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` ``[M, K]`` made contiguous, and M, N, K for a weight ``[N, K]`` (ValueError when the
    weight's K differs)."""
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns but the weight has {weight.shape[1]}; they must match")
    return x, m, n, k


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight ``[n, k]`` packed by ``pack_f32`` (``data``: its panels, 1-D); ``parts``
    equal row groups packed one after another (a fused gate_up: 2); ``cols``: the panels' width,
    the build's (48 with AVX-512, 16 otherwise), which only a build of the same width reads."""

    data: torch.Tensor
    n: int
    k: int
    parts: int = 1
    cols: int = 48


def packed_f32_layout(n: int, k: int, parts: int = 1) -> tuple[int, int]:
    """The float32 elements ``pack_f32`` makes of an ``[n, k]`` weight in ``parts``, and the panels'
    width (the build's): what a packed copy kept on disk must match (models/panel_cache.py)."""
    lib = _library_or_raise()
    return int(lib.plimsoll_packed_f32_floats(n, k, parts)), int(lib.plimsoll_packed_f32_panel_cols())


def pack_f32(weight: torch.Tensor, parts: int = 1, out: torch.Tensor | None = None) -> PackedWeight:
    """``weight`` (``[N, K]`` float32 on CPU) in column panels for ``packed_linear``: N padded up to
    whole panels (48 columns with AVX-512, 16 otherwise), each panel K rows of its columns. About
    the weight's own size again; the original is left as it is. ``out``: a float32 tensor of the
    packed size to pack into (a panel packed again after sleep, see ``FusedDecode.repack``)."""
    lib = _library_or_raise()
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_f32 takes a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    floats = lib.plimsoll_packed_f32_floats(n, k, parts)
    if floats == 0:
        raise ValueError(f"pack_f32: {parts} parts do not divide a weight of {n} rows")
    w = weight.detach().contiguous()
    if out is not None and (out.dtype != torch.float32 or out.numel() != floats or not out.is_contiguous()):
        raise ValueError(f"pack_f32: out must be a contiguous float32 tensor of {floats} elements")
    data = torch.empty(floats, dtype=torch.float32) if out is None else out
    if lib.plimsoll_pack_f32(w.data_ptr(), data.data_ptr(), n, k, parts, torch.get_num_threads()) != 0:
        raise ValueError(f"pack_f32 rejected a weight of {tuple(weight.shape)} in {parts} parts")
    return PackedWeight(data, n, k, parts, int(lib.plimsoll_packed_f32_panel_cols()))


def packed_linear(
    x: torch.Tensor,  # [M, K] float32 (rows may be strided, columns contiguous)
    weight: PackedWeight,
    bias: torch.Tensor | None = None,  # [N] float32
    out: torch.Tensor | None = None,  # [>= M, N] float32 (rows may be strided): written, or added to
    accumulate: bool = False,  # out += x @ W.T (+ bias) instead of out = ...
) -> torch.Tensor:
    """``x @ W.T + bias`` over a packed weight; returns ``out`` (a new ``[M, N]`` tensor if not given)."""
    lib = _library_or_raise()
    if lib.plimsoll_packed_f32_panel_cols() != weight.cols:
        raise ValueError(
            f"packed_linear: a weight packed in panels of {weight.cols} columns, and the {lib.variant} build reads "
            f"{lib.plimsoll_packed_f32_panel_cols()}; pack it again with the build in use"
        )
    m = x.shape[0]
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != weight.k or x.stride(1) != 1 or m == 0:
        raise ValueError(
            f"packed_linear: x must be [M > 0, {weight.k}] float32 with contiguous rows, got {x.dtype} {tuple(x.shape)}"
        )
    if out is None:
        if accumulate:
            raise ValueError("packed_linear: accumulate needs an out to add to")
        out = x.new_empty(m, weight.n)
    if out.dtype != torch.float32 or out.shape[0] < m or out.shape[1] != weight.n or out.stride(1) != 1:
        raise ValueError(f"packed_linear: out must be [>= {m}, {weight.n}] float32, got {out.dtype} {tuple(out.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.n,) or not bias.is_contiguous()):
        raise ValueError(f"packed_linear: bias must be contiguous float32 [{weight.n}]")
    rc = lib.plimsoll_packed_linear_f32(
        x.data_ptr(), x.stride(0), weight.data.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        out.stride(0), m, weight.n, weight.k, weight.parts, int(accumulate), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"packed_linear rejected x {tuple(x.shape)} against a packed {weight.n} x {weight.k}")
    return out


def fused_decode(
    x: torch.Tensor,  # [M, hidden] float32: embeddings in, the last layer's output out (in place)
    layers: torch.Tensor,  # [L, 8] int64 addresses (see csrc: norms, qkv, o, gate_up, down, k/v cache), [L, 20] for int8
    cos: torch.Tensor,  # [M, D]
    sin: torch.Tensor,  # [M, D]
    slot_mapping: torch.Tensor,  # [M] int64
    block_tables: torch.Tensor,  # [M, max_blocks] int32
    context_lens: torch.Tensor,  # [M] int32
    dims: tuple[int, int, int, int, int, int, int],  # hidden, H, Hkv, D, intermediate, block_size, num_slots
    eps: float,
    scale: float,
    int8: bool = False,
    packed: bool = False,
) -> None:
    """All decoder layers of a decode step on ``x`` in place; the caller (``models/fused_decode.py``)
    has checked that the model and the step fit and keeps the tensors alive. ``int8``: the
    projections are int8 with group scales (``layers`` holds their addresses; see csrc); ``packed``:
    float32 projections packed by ``pack_f32`` (gate_up in two parts), their panels' addresses."""
    lib = _library_or_raise()
    hidden, heads, kv_heads, head_dim, inter, block_size, num_slots = dims
    if layers.shape[1] != (20 if int8 else 8):
        raise ValueError(f"layers must be [L, {20 if int8 else 8}] addresses, got {tuple(layers.shape)}")
    weights = 2 if int8 else 1 if packed else 0  # the projections' layout, as csrc/decode_step.cpp numbers it
    rc = lib.plimsoll_fused_decode(
        x.data_ptr(), layers.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), x.shape[0], layers.shape[0], hidden, heads,
        kv_heads, head_dim, inter, block_size, block_tables.shape[1], num_slots, eps, scale, weights,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"fused decode rejected its inputs (code {rc}): heads {heads}/{kv_heads}, head_dim {head_dim}, "
            f"context lengths must be 1..{block_tables.shape[1] * block_size}, slots below {num_slots}"
            + (", int8 groups a multiple of 16 inputs dividing each projection's" if int8 else "")
        )


def _rows_fit(rows: int, *tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.shape[0] < rows:
            raise ValueError(
                f"expected contiguous {dtype} CPU tensors of at least {rows} rows, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device.type}"
            )


# The glue's types: float32 throughout, or a bfloat16 model's (bfloat16 matmul inputs and outputs
# and cache, the residual, the norm weights, cos/sin and q float32).
GLUE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _glue(lib: KernelLibrary, name: str, dtype: torch.dtype) -> Any:
    if dtype not in GLUE_DTYPES:
        raise ValueError(f"{name}: the glue runs float32 or bfloat16, got {dtype}")
    return getattr(lib, f"plimsoll_{name}_{GLUE_DTYPES[dtype]}")


def add_rms_norm(
    x: torch.Tensor,  # [>= M, dim] float32, updated in place: x += delta
    delta: torch.Tensor | None,  # [>= M, dim] of out's dtype, or None (nothing added)
    weight: torch.Tensor,  # [dim] float32
    out: torch.Tensor,  # [>= M, dim] float32 or bfloat16: RMSNorm(x) * weight
    rows: int,
    eps: float,
    threads: int = 0,  # 0: torch's intra-op threads
) -> None:
    """Rows ``[0, rows)``: ``x += delta`` then ``out = RMSNorm(x) * weight`` (a residual add and the
    next norm of a Llama layer, one call)."""
    lib = _library_or_raise()
    dim = x.shape[1]
    fn = _glue(lib, "add_rms_norm", out.dtype)
    _rows_fit(rows, x)
    _rows_fit(1, weight.view(1, -1))
    _rows_fit(rows, out, *(() if delta is None else (delta,)), dtype=out.dtype)
    if weight.shape != (dim,) or out.shape[1] != dim or (delta is not None and delta.shape[1] != dim):
        raise ValueError(f"add_rms_norm: x, delta, out and weight must all have {dim} columns")
    rc = fn(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim,
        eps, threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"add_rms_norm rejected {rows} rows of {dim}")


def rope_store(
    qkv: torch.Tensor,  # [>= M, (H + 2 Hkv) D]: a qkv projection's output, float32 or bfloat16
    q_out: torch.Tensor,  # [>= M, H * D] (or [.., H, D]) float32: q after RoPE
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] of qkv's dtype
    v_cache: torch.Tensor,
    cos: torch.Tensor,  # [M, D] float32
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [M] int64, -1: do not store
    rows: int,
    heads: tuple[int, int, int],  # H, Hkv, D
    threads: int = 0,
) -> None:
    """RoPE on each row's q (into ``q_out``) and k, and k and v stored in their cache slots."""
    lib = _library_or_raise()
    num_heads, num_kv_heads, head_dim = heads
    fn = _glue(lib, "rope_store", qkv.dtype)
    _rows_fit(rows, q_out, cos, sin)
    _rows_fit(rows, qkv, dtype=qkv.dtype)
    _rows_fit(0, k_cache, v_cache, dtype=qkv.dtype)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} or cache {tuple(k_cache.shape)} does not fit {heads}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.shape[0] < rows:
        raise ValueError("rope_store: slot_mapping must be contiguous int64 with a slot a row")
    rc = fn(
        qkv.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), rows, num_heads, num_kv_heads, head_dim, num_slots, threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"rope_store rejected its inputs (code {rc}): slots must be below {num_slots}, D even")


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, rows: int, threads: int = 0) -> None:
    """Rows ``[0, rows)``: ``out = SiLU(gate) * up`` where each row of ``gate_up`` is ``[gate | up]``
    (both float32, or both bfloat16)."""
    lib = _library_or_raise()
    inter = out.shape[1]
    fn = _glue(lib, "silu_mul", out.dtype)
    _rows_fit(rows, gate_up, out, dtype=out.dtype)
    if gate_up.shape[1] != 2 * inter:
        raise ValueError(f"silu_mul: gate_up has {gate_up.shape[1]} columns, out {inter}; need 2 x out's")
    rc = fn(gate_up.data_ptr(), out.data_ptr(), rows, inter, threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"silu_mul rejected {rows} rows of {inter}")


def to_bf16(x: torch.Tensor, out: torch.Tensor, threads: int = 0) -> None:
    """``out`` (contiguous bfloat16) = ``x`` (contiguous float32 of as many elements), rounded to
    the nearest even as torch rounds."""
    lib = _library_or_raise()
    if (
        x.dtype != torch.float32 or out.dtype != torch.bfloat16 or not x.is_contiguous()
        or not out.is_contiguous() or x.numel() != out.numel() or x.device.type != "cpu" or out.device.type != "cpu"
    ):  # fmt: skip
        raise ValueError(f"to_bf16: a contiguous float32 x and bfloat16 out of as many elements, got {x.dtype} "
                         f"{tuple(x.shape)} and {out.dtype} {tuple(out.shape)}")  # fmt: skip
    lib.plimsoll_to_bf16(x.data_ptr(), out.data_ptr(), x.numel(), threads or torch.get_num_threads())


FUSED_PARTS = ("norms, RoPE, KV store", "qkv matmul", "attention", "o_proj", "gate_up + SiLU*up", "down")


def fused_decode_timing(on: bool | None) -> dict[str, float]:
    """Milliseconds the fused step spent in each of ``FUSED_PARTS`` since timing was last
    switched; ``on`` (True/False) then switches it and zeroes the sums (None leaves it)."""
    lib = library()
    if lib is None:
        return {}
    out = (ctypes.c_double * len(FUSED_PARTS))()
    lib.plimsoll_fused_decode_timing(-1 if on is None else int(on), out)
    return {name: ns / 1e6 for name, ns in zip(FUSED_PARTS, out, strict=True)}
