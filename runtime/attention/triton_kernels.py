"""The Triton kernels behind ``plimsoll.runtime.attention.triton_backend`` (read that module first).

Only kernel bodies live here; shapes, checks, tile choices and launches are in
``triton_backend``. ``build()`` imports triton and decorates the kernels when
first needed, so importing this module needs neither triton nor a GPU.

Every load that feeds arithmetic is cast to fp32 first (the interpreter computes
bf16 arithmetic wrongly without a word). Reductions use ``tl.reduce`` with
triton's own combine functions rather than ``tl.max``/``tl.sum``: those helpers are
``@triton.jit`` functions decorated at ``import triton``, which breaks the
interpreter when TRITON_INTERPRET is set after that import; the combine functions
are never called by the interpreter (it recognises them and reduces with numpy).
"""

# Kernel source is formatted by hand: one argument group per line reads better
# than ruff's one argument per line.
# fmt: off
# Triton kernels take untyped arguments by design.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

# Filled in by build(); module globals so that the kernels' source (which Triton
# parses and re-executes in this module's namespace) can name them.
triton: Any = None
tl: Any = None
_max_combine: Any = None
_sum_combine: Any = None
_attend_kv: Any = None
_store_int8_rows: Any = None


def build(interpret: bool) -> SimpleNamespace:
    """Import triton and decorate the kernels; ``interpret`` must match TRITON_INTERPRET.

    ``triton.jit`` decides at decoration time, from TRITON_INTERPRET, whether it
    builds an interpreted or a compiled function. Callers cache the result per mode.
    """
    global triton, tl, _max_combine, _sum_combine, _attend_kv, _store_int8_rows
    try:
        import triton as _triton
        import triton.language as _tl
    except ImportError as exc:
        raise RuntimeError(
            "attention_backend='triton' needs the triton package: pip install 'plimsoll[gpu]', "
            "or use attention_backend='torch'"
        ) from exc
    triton, tl = _triton, _tl
    assert bool(triton.knobs.runtime.interpret) == interpret

    # Combine functions for tl.reduce; module globals because Triton resolves the
    # names a kernel calls in its module's namespace, not in closures. Triton's own
    # max/sum combiners come first: the interpreter recognises them by identity and
    # reduces with numpy (never calling them), while any other combiner is applied
    # element by element in Python, ~100x slower. Compiled, tl.max/tl.sum use them too.
    def max_combine(a, b):
        return tl.maximum(a, b)

    def sum_combine(a, b):
        return a + b

    _max_combine = getattr(tl.standard, "_elementwise_max", None) or triton.jit(max_combine)
    _sum_combine = getattr(tl.standard, "_sum_combine", None) or triton.jit(sum_combine)

    # The KV loop both attention kernels share: walk keys [start, end) of one
    # sequence in BLOCK_N tiles, gather each tile of paged K and V for one KV head
    # and fold it into the online softmax of q's ROWS rows (the GROUP query heads of
    # a decode program, or BLOCK_M query positions of a prefill tile). Returns the
    # unnormalised output and the running max and sum, which a decode split stores
    # for the merge. A module global, like the combiners, so the kernels can call it.
    # An int8 cache (attention/kv_int8.py): k/v_cache_ptr point at the value regions (strides of
    # kv_int8.values()), k/v_scale_ptr at the float32 scale regions (strides of kv_int8.scales(),
    # the same for K and V). The int8 tile converts exactly to the query's dtype; the K scale
    # multiplies the scores' columns and the V scale the probabilities' columns, so no
    # [BLOCK_N, HEAD_DIM] tile is ever dequantised.
    def attend_kv(
        q, start, end, q_pos,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq, kv_head, scale,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_s_block, stride_s_slot, stride_s_head,
        stride_bt,
        ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, COMPUTE_F32: tl.constexpr, CAUSAL: tl.constexpr, KV_INT8: tl.constexpr,
    ):
        if COMPUTE_F32:
            q = q.to(tl.float32)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        # A finite start (not -inf) so an empty decode split merges with weight 0, never NaN.
        run_max = tl.full([ROWS], -1.0e30, tl.float32)
        run_sum = tl.full([ROWS], 0.0, tl.float32)
        acc = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
        for tile in range(start, end, BLOCK_N):
            offs_n = tile + tl.arange(0, BLOCK_N)  # token positions in the sequence
            n_mask = offs_n < end
            page = tl.load(block_tables_ptr + seq * stride_bt + offs_n // PAGE_SIZE,
                           mask=n_mask, other=0).to(tl.int64)
            in_page = offs_n % PAGE_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_row = k_cache_ptr + page * stride_kc_block + in_page * stride_kc_slot + kv_head * stride_kc_head
            v_row = v_cache_ptr + page * stride_vc_block + in_page * stride_vc_slot + kv_head * stride_vc_head
            k = tl.load(k_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if KV_INT8:  # one float32 per key of the tile, from the block's scale region
                s_off = page * stride_s_block + in_page * stride_s_slot + kv_head * stride_s_head
                k_scale = tl.load(k_scale_ptr + s_off, mask=n_mask, other=0.0)
                v_scale = tl.load(v_scale_ptr + s_off, mask=n_mask, other=0.0)
            if COMPUTE_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, BLOCK_N]
            else:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
                scores = tl.dot(q, tl.trans(k))
            if KV_INT8:
                scores = scores * k_scale[None, :]
            scores = scores * scale
            # Causal (prefill): each row sees keys up to its own absolute position q_pos.
            # Decode: one query per sequence, after every key, so all of [tile, end).
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :] if CAUSAL else n_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            # Every row sees a key in the first tile (decode: each tile holds a real
            # key; prefill: key 0 is visible to all), so new_max is finite from then on.
            new_max = tl.maximum(run_max, tl.reduce(scores, 1, _max_combine))
            p = tl.exp(scores - new_max[:, None])
            alpha = tl.exp(run_max - new_max)
            run_sum = run_sum * alpha + tl.reduce(p, 1, _sum_combine)
            pw = p
            if KV_INT8:
                pw = p * v_scale[None, :]
            # In 16 bits the torch oracle also casts the probabilities to the value dtype.
            pv = tl.dot(pw, v, input_precision="ieee") if COMPUTE_F32 else tl.dot(pw.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            run_max = new_max
        return acc, run_max, run_sum

    _attend_kv = triton.jit(attend_kv)

    # One token's [Hkv, D] rows into an int8 cache (attention/kv_int8.py): the same bits as
    # kv_int8.quantize_rows (IEEE division, then round half to even: adding and taking away
    # 1.5 * 2^23 leaves the nearest integer, ties to even, for |r| <= 127).
    def store_int8_rows(x, values_dst, scales_dst, offs_h, offs_d, mask, h_mask, stride_val_head, stride_s_head):
        x = tl.where(mask, x.to(tl.float32), 0.0)
        amax = tl.reduce(tl.abs(x), 1, _max_combine)  # [BLOCK_H]
        row_scale = tl.maximum(amax / 127.0, 1.1754943508222875e-38)
        r = tl.math.div_rn(x, row_scale[:, None])
        r = (r + 12582912.0) - 12582912.0
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(values_dst + offs_h[:, None] * stride_val_head + offs_d[None, :], r.to(tl.int8), mask=mask)
        tl.store(scales_dst + offs_h * stride_s_head, row_scale, mask=h_mask)

    _store_int8_rows = triton.jit(store_int8_rows)

    # One token's K and V rows into its slot. A float cache takes a plain copy, no arithmetic,
    # so no fp32 detour: same dtype in and out stays bit-exact (the interpreter's bf16 rounding
    # differs). An int8 cache (KV_INT8): k/v_cache_ptr point at the value regions and
    # k/v_scale_ptr at the scale regions, with the strides attend_kv takes.
    @triton.jit
    def store_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
        stride_key_n, stride_key_h, stride_value_n, stride_value_h,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_s_block, stride_s_slot, stride_s_head,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_INT8: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:  # padding token: nothing to store
            return
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < NUM_KV_HEADS
        mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        # k, v: [BLOCK_H, BLOCK_D]
        k = tl.load(key_ptr + token * stride_key_n + offs_h[:, None] * stride_key_h + offs_d[None, :],
                    mask=mask, other=0.0)
        v = tl.load(value_ptr + token * stride_value_n + offs_h[:, None] * stride_value_h + offs_d[None, :],
                    mask=mask, other=0.0)
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
        if KV_INT8:
            s_off = block * stride_s_block + offset * stride_s_slot
            _store_int8_rows(k, k_dst, k_scale_ptr + s_off, offs_h, offs_d, mask, h_mask,
                             stride_kc_head, stride_s_head)
            _store_int8_rows(v, v_dst, v_scale_ptr + s_off, offs_h, offs_d, mask, h_mask,
                             stride_vc_head, stride_s_head)
        else:
            tl.store(k_dst + offs_h[:, None] * stride_kc_head + offs_d[None, :],
                     k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst + offs_h[:, None] * stride_vc_head + offs_d[None, :],
                     v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def decode_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, scale, num_splits,
        stride_q_n, stride_q_h, stride_o_n, stride_o_h,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_s_block, stride_s_slot, stride_s_head,
        stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_F32: tl.constexpr,
        KV_INT8: tl.constexpr,
    ):
        # One program per (KV head, sequence, split) serves all GROUP query heads of
        # that KV head: each K/V block is read once, not once per query head. The
        # heads are the rows of a [BLOCK_G, BLOCK_D] tile (BLOCK_G >= 16 for tl.dot).
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        split = tl.program_id(2)
        num_heads = tl.num_programs(0) * GROUP
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        ctx_len = tl.load(context_lens_ptr + seq)
        # This split's share of the context: [start, end)
        split_len = (ctx_len + num_splits - 1) // num_splits
        start = split * split_len
        end = tl.minimum(start + split_len, ctx_len)
        if q_len == 0:  # sequence with no query this step
            end = start

        offs_g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + offs_g  # query heads of this KV head
        offs_d = tl.arange(0, BLOCK_D)
        # Rows past GROUP are padding; no query row at all when q_len == 0 (q_start
        # may then point past the end).
        row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM * tl.minimum(q_len, 1))
        q = tl.load(query_ptr + q_start * stride_q_n + heads[:, None] * stride_q_h + offs_d[None, :],
                    mask=row_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
        acc, run_max, run_sum = _attend_kv(
            q, start, end, ctx_len, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq,
            kv_head, scale,
            stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
            stride_s_block, stride_s_slot, stride_s_head,
            stride_bt, BLOCK_G, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, COMPUTE_F32, False, KV_INT8,
        )
        if num_splits == 1:  # (Triton specialises 1: this branch is resolved at compile time)
            # The whole context was ours: normalise and write the output, no merge.
            out = acc / tl.maximum(run_sum, 1.0e-30)[:, None]  # run_sum >= 1 for a real query
            tl.store(out_ptr + q_start * stride_o_n + heads[:, None] * stride_o_h + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_mask)
        else:
            g_mask = offs_g < GROUP
            part = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
            tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
            tl.store(part_max_ptr + part, run_max, mask=g_mask)
            tl.store(part_sum_ptr + part, run_sum, mask=g_mask)

    @triton.jit
    def merge_splits_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, cu_seqlens_q_ptr, num_splits,
        stride_o_n, stride_o_h,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        head = tl.program_id(0)
        seq = tl.program_id(1)
        num_heads = tl.num_programs(0)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if q_len == 0:
            return
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < num_splits
        part = (seq * num_heads + head) * num_splits + offs_s  # [BLOCK_S]
        split_max = tl.load(part_max_ptr + part, mask=s_mask, other=-1.0e30)
        split_sum = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
        split_acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
                            mask=s_mask[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
        # Rescale every split to the global max: weight = exp(m_s - M)
        weight = tl.exp(split_max - tl.reduce(split_max, 0, _max_combine))
        total = tl.reduce(weight * split_sum, 0, _sum_combine)
        out = tl.reduce(weight[:, None] * split_acc, 0, _sum_combine) / total
        tl.store(out_ptr + q_start * stride_o_n + head * stride_o_h + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)

    @triton.jit
    def prefill_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
        block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        scale,
        stride_q_n, stride_q_h, stride_o_n, stride_o_h,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_s_block, stride_s_slot, stride_s_head,
        stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE_F32: tl.constexpr,
        KV_INT8: tl.constexpr,
    ):
        head = tl.program_id(0)  # fastest axis: query heads of one KV head side by side
        seq = tl.program_id(1)
        q_tile = tl.program_id(2)
        kv_head = head // GROUP
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if q_tile * BLOCK_M >= q_len:  # this sequence has fewer query tiles
            return
        ctx_len = tl.load(context_lens_ptr + seq)
        prefix_len = ctx_len - q_len  # tokens already cached before this step's queries

        offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q = tl.load(query_ptr + (q_start + offs_m)[:, None] * stride_q_n + head * stride_q_h + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        q_pos = prefix_len + offs_m  # absolute positions of the queries
        # Causal: the last query of this tile sees keys up to its own position.
        kv_end = tl.minimum(ctx_len, prefix_len + (q_tile + 1) * BLOCK_M)
        acc, _, run_sum = _attend_kv(
            q, 0, kv_end, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq,
            kv_head, scale,
            stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
            stride_s_block, stride_s_slot, stride_s_head,
            stride_bt, BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, COMPUTE_F32, True, KV_INT8,
        )
        # A padding sequence of a captured verify step has no context (run_sum 0): 0, not NaN.
        out = acc / tl.maximum(run_sum, 1.0e-30)[:, None]
        tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_o_n + head * stride_o_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])

    return SimpleNamespace(
        store_kv=store_kv_kernel, decode=decode_kernel, merge=merge_splits_kernel, prefill=prefill_kernel
    )
