"""The fused CPU decode step (``models/fused_decode.py``) against the module path.

On tiny random Llama and Mistral models (llama3 RoPE, GQA, random norm weights), with
float32 projections and with int8 ones (``--quantization int8``: both paths read the same
int8 weights): the hidden states and the KV written by one decode step agree within fp32 rounding for ragged
contexts, contexts that end on a block edge and just past one, shuffled block tables,
batches of 1 to 16. Steps it must not take (prefill or mixed rows, more rows than the CPU
plan's limits, an int8 cache, Qwen2's biases, Qwen3's q/k norm, the switch off) leave the
module path in charge. Through the engine: greedy output identical with and without it on mixed
prompts under prefix-cache hits, preemption and chunked prefill, float32 and int8. Each model
here runs under a CPU plan (``models/cpu_plan.py``) built as the engine's model runner builds
it, with the plan's switches set per case.
"""

import random
from typing import Any

import pytest
import torch
from kernel_builds import needs_kernels
from tiny_models import tiny_config

from plimsoll.runtime.attention import sdpa
from plimsoll.runtime.attention.attention_op import PagedAttend
from plimsoll.runtime.attention.backends import AttentionMetadata
from plimsoll.runtime.models import dense, fused_decode
from plimsoll.runtime.models.cpu_plan import CPUOptions, CPUPlan, RowLimits
from plimsoll.runtime.models.llama import LlamaForCausalLM
from plimsoll.runtime.models.quant import quantize_model

pytestmark = needs_kernels
ROWS = RowLimits()
BLOCK = 4
NUM_BLOCKS = 40
REAL_KERNEL = fused_decode.cpu_kernels.fused_decode
REAL_SILU_MUL = fused_decode.cpu_kernels.silu_mul  # called once a layer by the glued layers only


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fused kernel, still run, with each call recorded in the returned list."""
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        REAL_KERNEL(*args, **kwargs)

    monkeypatch.setattr(fused_decode.cpu_kernels, "fused_decode", counted)
    return calls


def count_glued_layers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Layer chunks the glued path ran (its SiLU kernel, still run once a layer for each chunk of
    up to ``dense.ONEDNN_CHUNK_ROWS`` rows, counted)."""
    calls: list[int] = []

    def counted(*args: Any) -> None:
        calls.append(1)
        REAL_SILU_MUL(*args)

    monkeypatch.setattr(fused_decode.cpu_kernels, "silu_mul", counted)
    return calls


def randomised(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` with weights drawn around what a trained one holds (norms near 1), in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0))
    return model


def random_model(arch: str, weights: str = "float32") -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = randomised(LlamaForCausalLM(tiny_config(arch)).eval())
    if weights == "int8":
        quantize_model(model, "int8", torch.float32)  # both paths then read the same int8 weights
    return model


def decode_batch(model: LlamaForCausalLM, contexts: list[int], seed: int) -> tuple[Any, ...]:
    """One decode row per sequence: its new token sits at position ``ctx - 1``."""
    rng = random.Random(seed)
    attn = model.model.layers[0].self_attn
    num_blocks = max(NUM_BLOCKS, sum(-(-c // BLOCK) for c in contexts) + 8)
    shape = (num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in model.model.layers]
    free = list(range(num_blocks))
    rng.shuffle(free)
    max_blocks = max(-(-c // BLOCK) for c in contexts) + 1  # one spare -1 column
    tables, slots = [], []
    for ctx in contexts:
        blocks = [free.pop() for _ in range(-(-ctx // BLOCK))]
        tables.append(blocks + [-1] * (max_blocks - len(blocks)))
        slots.append(blocks[(ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK)
    n = len(contexts)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        max_q_len=1,
    )
    ids = torch.tensor([rng.randrange(model.config.vocab_size) for _ in contexts])
    positions = torch.tensor([c - 1 for c in contexts])
    return ids, positions, caches, meta


def plan(model: LlamaForCausalLM, fused: bool = True, glued: bool = True, packed: bool = True) -> CPUPlan:
    """The model's CPU plan with these switches, attached to it (as the engine's model runner does)."""
    return CPUPlan(model, CPUOptions(fused_decode=fused, glued_layers=glued, packed_weights=packed))


def forward(
    model: LlamaForCausalLM,
    batch: tuple[Any, ...],
    fused: bool,
    monkeypatch: pytest.MonkeyPatch,
    glued: bool = False,
    packed: bool = True,
) -> Any:
    """Hidden states, caches after the step, and fused-kernel calls. ``fused`` and ``glued`` both
    off: the module path (the reference)."""
    ids, positions, caches, meta = batch
    caches = [(k.clone(), v.clone()) for k, v in caches]
    plan(model, fused, glued, packed)
    calls = count_kernel_calls(monkeypatch)
    with torch.inference_mode():
        hidden = model(ids, positions, PagedAttend(caches, meta, sdpa.store_kv, sdpa.paged_attention))
    return hidden, caches, len(calls)


CONTEXTS = {
    "one token": [1],
    "one sequence on a block edge": [8],
    "one sequence past a block edge": [9],
    "ragged four": [13, 4, 5, 27],
    "ragged three, long": [70, 2, 33],
    "ragged twelve (register blocks and a remainder)": [3, 9, 1, 12, 7, 4, 16, 5, 2, 8, 11, 6],
    "sixteen": [1 + (7 * i) % 13 for i in range(16)],
}


@pytest.mark.parametrize("weights", ["float32", "float32 plain rows", "int8"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("case", sorted(CONTEXTS))
def test_fused_step_equals_the_module_path(arch: str, case: str, weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # float32: the projections in column panels (the default); "plain rows": --no-cpu-packed-weights.
    packed = weights != "float32 plain rows"
    model = random_model(arch, "int8" if weights == "int8" else "float32")
    batch = decode_batch(model, CONTEXTS[case], seed=len(case))
    want, want_caches, _ = forward(model, batch, False, monkeypatch, packed=packed)
    got, got_caches, calls = forward(model, batch, True, monkeypatch, packed=packed)
    fused = model.cpu_plan.fused
    assert calls == 1, fused.reason
    assert bool(fused.panels) is (weights == "float32")
    assert model.cpu_plan.last_path == "fused_decode"
    err = (got - want).abs().max().item()
    print(f"{arch} {weights} {case}: max abs error {err:.2e} (hidden max {want.abs().max().item():.1f})")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)  # the new token's K, after RoPE
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("case", ["ragged three, long", "ragged twelve (register blocks and a remainder)"])
def test_fused_step_on_shapes_that_leave_remainders(case: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # hidden 70 and intermediate 90: inputs not a multiple of 16 (the kernels' vector tails), 98 q/k/v
    # and 70 output rows (not whole register blocks of W rows, nor whole panels: 48 + 22 columns,
    # each gate and up part 48 + 42); 5 query heads on one KV head.
    from transformers import LlamaConfig

    from plimsoll.runtime.testing import TINY_SHAPE

    config = LlamaConfig(
        **{**TINY_SHAPE, "hidden_size": 70, "intermediate_size": 90, "num_attention_heads": 5, "num_key_value_heads": 1}
    )
    torch.manual_seed(1)
    model = randomised(LlamaForCausalLM(config).eval())
    batch = decode_batch(model, CONTEXTS[case], seed=5)
    want, want_caches, _ = forward(model, batch, False, monkeypatch, packed=packed)
    got, got_caches, calls = forward(model, batch, True, monkeypatch, packed=packed)
    assert calls == 1, model.cpu_plan.fused.reason
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [17, 64, 128])
def test_fused_step_over_panels_takes_up_to_128_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Over column panels the fused step takes decode steps up to the plan's fused_panels rows (its
    # matmuls are the glued layers' own there): long ragged contexts, several blocks of 8 rows a panel.
    model = random_model("llama")
    batch = decode_batch(model, [20 + (37 * i) % 90 for i in range(rows)], seed=rows)
    want, want_caches, _ = forward(model, batch, False, monkeypatch)
    got, got_caches, calls = forward(model, batch, True, monkeypatch)
    assert calls == 1 and model.cpu_plan.fused.panels
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=5e-5)


def step_batch(model: LlamaForCausalLM, seqs: list[tuple[int, int]], seed: int) -> tuple[Any, ...]:
    """A step of any shape: each sequence ``(context, new tokens)`` has its last ``new`` tokens in
    the step (1: a decode row; the whole context: a first prefill; between: after a prefix hit
    or an earlier chunk). Rows are in sequence order, as the scheduler packs them."""
    rng = random.Random(seed)
    attn = model.model.layers[0].self_attn
    num_blocks = sum(-(-c // BLOCK) for c, _ in seqs) + 8  # a few never used
    shape = (num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in model.model.layers]
    free = list(range(num_blocks))
    rng.shuffle(free)
    max_blocks = max(-(-c // BLOCK) for c, _ in seqs)
    tables, slots, positions, cu = [], [], [], [0]
    for ctx, new in seqs:
        blocks = [free.pop() for _ in range(-(-ctx // BLOCK))]
        tables.append(blocks + [-1] * (max_blocks - len(blocks)))
        for pos in range(ctx - new, ctx):
            slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
        cu.append(cu[-1] + new)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        max_q_len=max(new for _, new in seqs),
    )
    ids = torch.tensor([rng.randrange(model.config.vocab_size) for _ in positions])
    return ids, torch.tensor(positions), caches, meta


GLUED_STEPS = {
    "five decode rows": [(c, 1) for c in (3, 9, 1, 12, 7)],
    "seventeen decode rows (above the plain-row limit)": [(1 + (7 * i) % 23, 1) for i in range(17)],
    "sixty decode rows, long contexts": [(20 + (37 * i) % 90, 1) for i in range(60)],
    "one prefill": [(45, 45)],
    "mixed: decodes, a prefix hit, a later chunk, a first prefill": [
        (9, 1),
        (30, 10),
        (5, 1),
        (60, 16),
        (21, 21),
    ],
    "prefill above a chunk of 256 rows": [(150, 150), (140, 140), (2, 1)],
}


@pytest.mark.parametrize("weights", ["panels", "oneDNN over plain rows"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("case", sorted(GLUED_STEPS))
def test_glued_step_equals_the_module_path(arch: str, case: str, weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = weights == "panels"
    model = random_model(arch)
    batch = step_batch(model, GLUED_STEPS[case], seed=len(case))
    want, want_caches, _ = forward(model, batch, False, monkeypatch, packed=packed)
    glue_calls = count_glued_layers(monkeypatch)
    got, got_caches, fused_calls = forward(model, batch, False, monkeypatch, glued=True, packed=packed)
    chunks = -(-batch[0].shape[0] // dense.ONEDNN_CHUNK_ROWS)
    glued = model.cpu_plan.glued
    assert fused_calls == 0 and len(glue_calls) == len(model.model.layers) * chunks, glued.reason
    assert glued.panels is packed and model.cpu_plan.last_path == "glued_layers"
    err = (got - want).abs().max().item()
    print(
        f"{arch} {case}: {batch[0].shape[0]} rows, max abs error {err:.2e} (hidden max {want.abs().max().item():.1f})"
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Deeper layers' K and V carry the norms' rounding (the kernel sums squares in another order
    # than torch's rms_norm) through the layers before: ~1e-5 at hidden values of ~4.
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("case", ["mixed: decodes, a prefix hit, a later chunk, a first prefill", "prefill above a chunk of 256 rows"])
def test_glued_step_with_head_dim_64_runs_the_ragged_attention_kernel(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # head_dim 64 (SmolLM2's): prefill and mixed steps' attention is the compiled ragged kernel,
    # written straight into the o_proj's input; the module path with torch's SDPA is the reference.
    model = head_dim_64_model()
    batch = step_batch(model, GLUED_STEPS[case], seed=7)
    with monkeypatch.context() as torch_attention:
        torch_attention.setattr(fused_decode.cpu_kernels, "supports_paged_attention", lambda *a: False)
        want, want_caches, _ = forward(model, batch, False, monkeypatch)
    calls: list[int] = []
    real = fused_decode.cpu_kernels.paged_attention
    monkeypatch.setattr(fused_decode.cpu_kernels, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    glue_calls = count_glued_layers(monkeypatch)
    got, got_caches, _ = forward(model, batch, False, monkeypatch, glued=True)
    assert glue_calls and len(calls) == len(model.model.layers), model.cpu_plan.glued.reason
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_float32_weights_are_packed_in_panels_unless_told_not_to(
    packed: bool, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Packed (the default): each projection and the output head once in column panels, a second
    # copy beside the plain weight the module path reads, shared by the fused step, the glued
    # layers and compute_logits. Off: oneDNN and the plain-row kernel read the plain weights. The
    # step's and the logits' results are the module path's either way.
    from transformers import LlamaConfig

    from plimsoll.runtime.testing import TINY_SHAPE

    torch.manual_seed(3)
    model = randomised(LlamaForCausalLM(LlamaConfig(**{**TINY_SHAPE, "tie_word_embeddings": tied})).eval())
    batch = step_batch(model, GLUED_STEPS["prefill above a chunk of 256 rows"], seed=11)
    want, _, _ = forward(model, batch, False, monkeypatch, packed=packed)
    got, _, _ = forward(model, batch, False, monkeypatch, glued=True, packed=packed)
    fused, glued = model.cpu_plan.fused, model.cpu_plan.glued
    assert fused is not None and glued is not None and glued.reason is None
    assert glued.panels is packed and not glued.packed and bool(fused.panels) is packed
    qkv, plain_qkv = glued.layers[0][1], model.model.layers[0].self_attn.qkv_proj.weight
    if packed:
        assert isinstance(qkv, fused_decode.cpu_kernels.PackedWeight) and (qkv.n, qkv.k) == tuple(plain_qkv.shape)
        head = model.model.embed_tokens.weight if tied else model.lm_head.weight
        assert fused.head is not None and (fused.head.n, fused.head.k) == tuple(head.shape)
    else:
        assert qkv is plain_qkv and fused.head is None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    rows = torch.randn(37, model.config.hidden_size)
    plain = rows @ (model.model.embed_tokens.weight if tied else model.lm_head.weight).T
    torch.testing.assert_close(model.compute_logits(rows), plain, rtol=1e-4, atol=1e-4)


BF16_STEPS = {
    **GLUED_STEPS,
    "one decode row": [(7, 1)],
    "two decode rows": [(5, 1), (9, 1)],
    "three prefills of 250 (torch's SDPA in bf16)": [(250, 250)] * 3 + [(30, 1)],
}


def head_dim_64_model() -> LlamaForCausalLM:
    """A tiny Llama with SmolLM2's head_dim (the ragged attention kernel's)."""
    from transformers import LlamaConfig

    from plimsoll.runtime.testing import TINY_SHAPE

    config = LlamaConfig(**{**TINY_SHAPE, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})
    torch.manual_seed(2)
    return randomised(LlamaForCausalLM(config).eval())


def bf16_models(arch: str) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A bfloat16 model and a float32 one holding the very same (bf16-rounded) weights."""
    make = head_dim_64_model if arch == "head_dim 64" else lambda: random_model(arch)
    low = make().to(torch.bfloat16)
    ref = make()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), low.parameters(), strict=True):
            p.copy_(q.float())
    return low, ref


def run_bf16_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no native bf16 matmul the glue stands aside (tested below); here it runs
    anyway (oneDNN converts internally: slower, the same rounding of inputs and outputs)."""
    monkeypatch.setattr(fused_decode, "_bf16_matmul_reason", lambda: None)


@pytest.mark.parametrize("arch", ["llama", "head_dim 64"])
@pytest.mark.parametrize("case", sorted(BF16_STEPS))
def test_bf16_glued_step_is_as_close_to_float32_as_the_module_path(
    arch: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bfloat16 model's glued step (bf16 matmuls and cache; float32 residual, norms, RoPE and
    # attention) and its module path (torch's bf16 ops), each against the float32 module path over
    # the same weights and cache values: the glue, which rounds once a layer where the module
    # path rounds after every op, must be no further off (RMS), in the output and in the layers' K/V.
    low, ref = bf16_models(arch)
    ids, positions, caches, meta = step_batch(ref, BF16_STEPS[case], seed=len(case))
    low_caches = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
    want, want_caches, _ = forward(ref, (ids, positions, [(k.float(), v.float()) for k, v in low_caches], meta), False, monkeypatch)
    module, module_caches, _ = forward(low, (ids, positions, low_caches, meta), False, monkeypatch)
    run_bf16_glue(monkeypatch)
    glue_calls = count_glued_layers(monkeypatch)
    ragged: list[int] = []
    real = fused_decode.cpu_kernels.paged_attention
    monkeypatch.setattr(fused_decode.cpu_kernels, "paged_attention", lambda *a, **k: ragged.append(1) or real(*a, **k))
    got, got_caches, _ = forward(low, (ids, positions, low_caches, meta), False, monkeypatch, glued=True)
    chunks = -(-ids.shape[0] // dense.ONEDNN_CHUNK_ROWS)
    assert len(glue_calls) == len(low.model.layers) * chunks, low.cpu_plan.glued.reason
    # Prefill and mixed steps at head_dim 64: the ragged kernel, or torch's SDPA once the prefills are long.
    kernel = (
        arch == "head_dim 64"
        and meta.max_q_len > 1
        and fused_decode._prefill_pairs(meta) < fused_decode.BF16_SDPA_MIN_PAIRS
    )
    assert len(ragged) == (len(low.model.layers) if kernel else 0)
    assert got.dtype == torch.bfloat16 and got_caches[0][0].dtype == torch.bfloat16

    def worst(a: torch.Tensor, b: torch.Tensor) -> float:  # root-mean-square: one element's max is noise
        return (a.float() - b.float()).pow(2).mean().sqrt().item()

    glue_err, module_err = worst(got, want), worst(module, want)
    cache_errs = [
        (max(worst(gk, wk), worst(gv, wv)), max(worst(mk, wk), worst(mv, wv)))
        for (gk, gv), (mk, mv), (wk, wv) in zip(got_caches, module_caches, want_caches, strict=True)
    ]  # fmt: skip
    print(f"{case}: {ids.shape[0]} rows; RMS error against float32, glue {glue_err:.4f}, module path "
          f"{module_err:.4f} (hidden RMS {want.pow(2).mean().sqrt().item():.2f}); K/V per layer "
          f"{[(round(g, 4), round(m, 4)) for g, m in cache_errs]}")  # fmt: skip
    assert glue_err <= 1.1 * module_err
    # Over all layers' K and V (one layer's few stored rows make a noisy figure alone).
    glue_kv, module_kv = (sum(errs[i] ** 2 for errs in cache_errs) ** 0.5 for i in (0, 1))
    assert glue_kv <= 1.1 * module_kv


def test_bf16_glue_stands_aside_without_native_bf16_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_decode, "_bf16_matmul_reason", lambda: "oneDNN has no native bfloat16 matmul on this CPU")
    low, _ = bf16_models("llama")
    ids, positions, caches, meta = step_batch(low, BF16_STEPS["one prefill"], seed=4)
    batch = (ids, positions, [(k.bfloat16(), v.bfloat16()) for k, v in caches], meta)
    want, _, _ = forward(low, batch, False, monkeypatch)
    glue_calls = count_glued_layers(monkeypatch)
    got, _, _ = forward(low, batch, False, monkeypatch, glued=True)
    assert glue_calls == [] and torch.equal(got, want)  # the module path, bit for bit
    assert "no native bfloat16" in str(low.cpu_plan.glued.reason)
    assert "layer by layer" in low.cpu_plan.describe()


def test_steps_the_glued_layers_leave_to_the_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    float_model = random_model("llama")
    small = step_batch(float_model, [(9, 3), (4, 1)], seed=1)  # 4 rows: the small-batch matmul's
    int8_model = random_model("llama", "int8")
    big = step_batch(int8_model, [(30, 30)], seed=2)
    glued = count_glued_layers(monkeypatch)
    for model, batch in ((float_model, small), (int8_model, big)):
        want, _, _ = forward(model, batch, False, monkeypatch)
        got, _, _ = forward(model, batch, False, monkeypatch, glued=True)
        assert torch.equal(got, want)  # bitwise: the very same ops ran
    assert glued == []
    assert "int8" in str(int8_model.cpu_plan.glued.reason)
    qwen3 = random_model("qwen3")
    forward(qwen3, step_batch(qwen3, [(30, 30)], seed=3), False, monkeypatch, glued=True)
    assert "q/k norm" in str(qwen3.cpu_plan.glued.reason)


def test_steps_it_cannot_take_run_the_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model("llama")
    most = decode_batch(model, [1 + i % 5 for i in range(ROWS.fused_panels)], seed=1)
    assert forward(model, most, True, monkeypatch)[2] == 1  # over column panels, up to fused_panels rows
    too_many = decode_batch(model, [1 + i % 5 for i in range(ROWS.fused_panels + 1)], seed=1)
    assert forward(model, too_many, True, monkeypatch)[2] == 0  # above: the glued layers
    plain = random_model("llama")
    most = decode_batch(plain, [1 + i % 5 for i in range(ROWS.fused_plain)], seed=1)
    assert forward(plain, most, True, monkeypatch, packed=False)[2] == 1
    too_many = decode_batch(plain, [1 + i % 5 for i in range(ROWS.fused_plain + 1)], seed=1)
    assert forward(plain, too_many, True, monkeypatch, packed=False)[2] == 0  # plain rows above: oneDNN's matmuls win
    # A plan given other limits moves the edge with them.
    CPUPlan(plain, CPUOptions(packed_weights=False, rows=RowLimits(fused_plain=3)))
    calls = count_kernel_calls(monkeypatch)
    four = decode_batch(plain, [4, 5, 6, 7], seed=1)
    with torch.inference_mode():
        ids4, positions4, caches4, meta4 = four
        plain(ids4, positions4, PagedAttend(caches4, meta4, sdpa.store_kv, sdpa.paged_attention))
    assert calls == [] and plain.cpu_plan.last_path == "module_layers"  # 4 rows: neither fused nor glued (5)

    ids, positions, caches, meta = decode_batch(model, [6, 9], seed=2)
    # A mixed step: the first sequence's last 3 tokens (prefill) and one decode row.
    mixed = AttentionMetadata(
        slot_mapping=torch.cat((meta.slot_mapping[:1] - 2, meta.slot_mapping[:1] - 1, meta.slot_mapping)),
        block_tables=meta.block_tables,
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        context_lens=meta.context_lens,
        max_q_len=3,
    )
    mixed_batch = (torch.cat((ids[:1], ids[:1], ids)), torch.cat((positions[:1] - 2, positions[:1] - 1, positions)))
    assert forward(model, (*mixed_batch, caches, mixed), True, monkeypatch)[2] == 0

    int8 = [(k.to(torch.int8), v.to(torch.int8)) for k, v in caches]
    with torch.inference_mode():
        assert not model.cpu_plan.fused.run(
            model.model.embed_tokens(ids), *model.model.rotary_emb(positions, torch.float32),
            PagedAttend(int8, meta, sdpa.store_kv, sdpa.paged_attention),
        )  # fmt: skip
    assert forward(model, (ids, positions, caches, meta), False, monkeypatch)[2] == 0  # cpu_fused_decode=False


@pytest.mark.parametrize(("arch", "reason"), [("qwen2", "biases"), ("qwen3", "q/k norm")])
def test_models_it_does_not_cover_say_why(arch: str, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model(arch)
    batch = decode_batch(model, [5, 9], seed=3)
    assert forward(model, batch, True, monkeypatch)[2] == 0
    assert reason in str(model.cpu_plan.fused.reason) and reason in model.cpu_plan.describe()


def mixed_prompts(seed: int, count: int = 12) -> list[list[int]]:
    """Short and long; some share a 40-token head (prefix-cache hits)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 259) for _ in range(40)]
    return [(head if i % 3 == 0 else []) + [rng.randrange(3, 259) for _ in range(rng.randrange(2, 70))] for i in range(count)]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_engine_greedy_identical_with_and_without(
    tiny_model_dir: Any, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plimsoll.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(4)
    outs, stats = {}, {}
    # The module path; the fused step alone; both (the default). With 8 sequences at a time the
    # glued layers take the mixed and prefill steps (each above the small-batch matmul's 4 rows).
    for mode in ("module", "fused", "fused + glued"):
        # 14 blocks of 16 for 12 sequences of up to ~134 tokens, 8 at a time: preemption is certain.
        llm = LLM(
            model=str(tiny_model_dir("llama")), kv_cache_memory=14 * 16 * 512, max_model_len=224,
            max_num_seqs=8, max_num_batched_tokens=48, enable_prefix_caching=True, quantization=quantization,
            cpu_fused_decode=mode != "module", cpu_glued_layers=mode == "fused + glued",
        )  # fmt: skip
        calls = count_kernel_calls(monkeypatch)
        glued = count_glued_layers(monkeypatch)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats[mode] = (len(calls), len(glued), llm.engine.scheduler.total_preemptions)
    print(f"fused steps, glued layer calls, preemptions: {stats}")
    assert stats["module"][:2] == (0, 0) and stats["fused"][0] > 0 and stats["fused"][1] == 0
    assert stats["fused + glued"][0] > 0
    assert (stats["fused + glued"][1] > 0) == (quantization is None)  # int8 projections: not glued
    assert all(preemptions > 0 for _, _, preemptions in stats.values())
    assert outs["fused"] == outs["module"]
    assert outs["fused + glued"] == outs["module"]


def test_without_the_kernels_the_plan_says_why_and_runs_the_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = "libplimsoll_cpu_avx512.so is not installed (no C++ compiler at install)"
    monkeypatch.setattr(fused_decode.cpu_kernels, "library", lambda: None)
    monkeypatch.setattr(fused_decode.cpu_kernels, "unavailable_reason", lambda: reason)
    model = random_model("llama")
    batch = decode_batch(model, [5, 9], seed=3)
    want, _, _ = forward(model, batch, False, monkeypatch)
    got, _, calls = forward(model, batch, True, monkeypatch, glued=True)
    assert calls == 0 and torch.equal(got, want) and model.cpu_plan.last_path == "module_layers"
    line = model.cpu_plan.describe()
    assert line.startswith("kernels: torch only on CPU") and reason in line, line


def bf16_generate(
    m: pytest.MonkeyPatch, prompts: list[str], params: Any, kernels: bool
) -> tuple[list[list[int]], dict[str, int]]:
    """The embedded SmolLM2 in bfloat16: greedy token ids (the prompts at once, then the first
    alone, one row a step) and how often each bf16 kernel ran (``glue``: glued layer chunks)."""
    from plimsoll.runtime import LLM
    from plimsoll.runtime.kernels import cpu_kernels

    seen: list[str] = []
    real_attention, real_linear = cpu_kernels.decode_attention, cpu_kernels.bf16_linear
    m.setattr(cpu_kernels, "decode_attention", lambda *a, **k: seen.append("attention") or real_attention(*a, **k))
    m.setattr(cpu_kernels, "bf16_linear", lambda *a, **k: seen.append("linear") or real_linear(*a, **k))
    m.setattr(cpu_kernels, "silu_mul", lambda *a: seen.append("glue") or REAL_SILU_MUL(*a))
    llm = LLM(
        model="smollm2-135m", dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=256,
        cpu_kernels="auto" if kernels else "off",
    )  # fmt: skip
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ids += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    return ids, {name: seen.count(name) for name in ("attention", "linear", "glue")}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_bfloat16_engine_agrees_with_and_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # --dtype bfloat16 on CPU, the embedded SmolLM2 (head_dim 64): where oneDNN has native bf16
    # matmuls (AVX512_BF16, AMX) every step is glued (bf16 matmuls, float32 residual and
    # attention); decode attention reads the bf16 cache in the compiled kernel and the output
    # head's 1-2 row matmuls take bf16_linear; with all off, torch's bf16 ops. Each rounds in its
    # own order, so greedy text may part at a near tie: most tokens before the first parting
    # must agree, and both paths must have run.
    from plimsoll.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [
        "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "List three primary colours:",
        "Explain what a GPU is in one sentence.", "1, 2, 3, 4,", "Translate 'good morning' to Spanish:", "Once upon a time",
    ]  # fmt: skip
    outs, calls = {}, {}
    for mode in ("kernels", "torch"):
        with monkeypatch.context() as m:
            outs[mode], calls[mode] = bf16_generate(m, prompts, params, kernels=mode == "kernels")
    agree = sum(common_prefix(a, b) for a, b in zip(outs["kernels"], outs["torch"], strict=True))
    total = sum(len(x) for x in outs["torch"])
    print(f"bfloat16 greedy tokens before the first parting, with and without the kernels: {agree}/{total}; "
          f"kernel calls {calls}")  # fmt: skip
    assert calls["kernels"]["attention"] > 0 and calls["kernels"]["linear"] > 0
    assert (calls["kernels"]["glue"] > 0) == (fused_decode._bf16_matmul_reason() is None)
    assert calls["torch"] == {"attention": 0, "linear": 0, "glue": 0}
    assert agree >= 0.75 * total
