"""`plimsoll plan`: offline capacity planning from a model's config.json and a GPU's memory.

What it is: the arithmetic of how many sequences fit on one replica and how many
replicas a load needs, with every step shown —

- parameters estimated from the config's dimensions (Llama-family decoders:
  embeddings, attention with grouped-query KV heads, gated MLP or mixture of
  experts, norms), weight bytes = parameters × dtype bytes;
- tensor parallelism over N GPUs per replica (vLLM's ``--tensor-parallel-size``, as
  ``plimsoll serve`` shards): query heads, MLP columns and the vocabulary are split
  N ways, KV heads split or (fewer KV heads than GPUs) replicated, norms replicated
  (``common/tp_split.py``), so every figure below is per GPU: weight bytes per
  GPU, KV bytes per token per GPU (its KV heads only);
- KV bytes per token = 2 × layers × kv_heads (per GPU) × head_dim × KV dtype bytes (int8:
  head_dim + 4 bytes per row, the float32 scale the runtime stores with each token and KV head);
- KV tokens that fit: the rule ``plimsoll serve`` applies (``plimsoll.kv_memory``, vLLM's
  ``--gpu-memory-utilization``): GPU memory × memory fraction, less the weights per GPU,
  the activations of the largest step and the sampler's tensors (estimated here from
  ``--max-num-batched-tokens`` and ``--max-num-seqs``; the engine measures them), and
  memory outside torch, ÷ KV bytes per token per GPU, in whole blocks (every GPU holds the
  same tokens: block tables are shared);
- GPUs a replica needs: the smallest valid split whose weights per GPU leave room for
  one sequence at full context;
- concurrent sequences at a context length = KV tokens ÷ context length;
- with a bench report (its per-replica recommendation) or a given per-replica
  concurrency and a target load (concurrency, or requests/s × latency by
  Little's law): replicas = ceil(load ÷ per-replica), GPUs = replicas × GPUs per replica.

What it is not: a memory profiler. The activation and outside-torch figures are
estimates where the engine measures (its start-up line prints both), CUDA graphs
and allocator fragmentation are not modelled, and the sequence count assumes
every request uses the whole context, so it is a floor on what really fits.
"""

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from plimsoll import tp_split
from plimsoll.byte_size import parse_bytes
from plimsoll.kv_memory import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    NON_TORCH_BYTES_ESTIMATE,
    KVCacheBudget,
    activation_bytes_estimate,
)

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
    "fp8": 1, "int8": 1, "int4": 0.5,
}  # fmt: skip
GiB = 2**30


class PlanError(ValueError):
    """Input `plimsoll plan` cannot use; the message says what to change."""


def memory_size(text: str) -> int:
    """A GPU memory size such as 80GiB or 80GB, or :class:`PlanError` saying how to write one."""
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise PlanError(str(err)) from None


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The architecture numbers planning needs, read from a Hugging Face config.json."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    experts: int  # 1 for a dense MLP
    max_position: int | None


def read_model_config(path: Path) -> ModelDims:
    """Read config.json (or a model directory holding one) into :class:`ModelDims`."""
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg: dict[str, Any] = json.loads(file.read_text())
    except FileNotFoundError:
        raise PlanError(f"no model config at {file}; pass a config.json or the model directory") from None
    except json.JSONDecodeError as err:
        raise PlanError(f"{file} is not JSON: {err}") from None
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}  # multimodal wrappers keep the decoder's numbers here

    def need(key: str) -> int:
        if not isinstance(cfg.get(key), int):
            raise PlanError(
                f"{file} has no integer {key!r}; plan reads Llama-family decoder configs "
                "(hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size)"
            )
        return int(cfg[key])

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    model_type = str(cfg.get("model_type", "unknown"))
    return ModelDims(
        model_type=model_type,
        layers=need("num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),  # absent means plain multi-head attention
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate=need("intermediate_size"),
        vocab=need("vocab_size"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 puts biases on q/k/v; Llama-style configs say so with attention_bias.
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        experts=int(cfg.get("num_local_experts") or 1),
        max_position=cfg.get("max_position_embeddings"),
    )


def parameter_count(d: ModelDims) -> int:
    """Parameters of a Llama-family decoder from its dimensions."""
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention = d.hidden * q_out + 2 * d.hidden * kv_out + q_out * d.hidden
    if d.qkv_bias:
        attention += q_out + 2 * kv_out
    mlp = 3 * d.hidden * d.intermediate * d.experts  # gate, up, down per expert
    router = d.hidden * d.experts if d.experts > 1 else 0
    norms = 2 * d.hidden
    embeddings = d.vocab * d.hidden * (1 if d.tied_embeddings else 2)
    return d.layers * (attention + mlp + router + norms) + embeddings + d.hidden


# The runtime's --quantization int8 layout (runtime/models/quant.py GROUP_SIZE, ASYMMETRIC):
# a float32 scale and a float32 offset per 32 inputs of each row (0 = per row).
INT8_GROUP_SIZE = 32
INT8_OFFSETS = True


def int8_weight_bytes(d: ModelDims, group: int = INT8_GROUP_SIZE, offsets: bool = INT8_OFFSETS) -> int:
    """Bytes of the weights under plimsoll's ``--quantization int8``: every matrix in int8 plus
    one float32 scale (and with ``offsets`` one float32 offset) per ``group`` inputs of each
    output row (per row where ``group`` does not divide the row); norms and biases stay float32."""
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    # (inputs, output rows) of each matrix of one layer: qkv, o, gate_up, down (per expert).
    layer = [(d.hidden, q_out + 2 * kv_out), (q_out, d.hidden)]
    layer += [(d.hidden, 2 * d.intermediate), (d.intermediate, d.hidden)] * d.experts
    embeddings = [(d.hidden, d.vocab)] * (1 if d.tied_embeddings else 2)

    def scales(k: int, n: int) -> int:
        return n * (k // group if 0 < group < k and k % group == 0 else 1)

    matrices = d.layers * sum(k * n for k, n in layer) + sum(k * n for k, n in embeddings)
    scale_count = d.layers * sum(scales(k, n) for k, n in layer) + sum(scales(k, n) for k, n in embeddings)
    other = parameter_count(d) - matrices
    return matrices + 4 * (scale_count * (2 if offsets else 1) + other)


def parameters_per_gpu(d: ModelDims, tp: int) -> int:
    """Parameters one GPU holds when the replica is split ``tp`` ways (``parameter_count`` at 1)."""
    q_out = d.heads * d.head_dim // tp
    kv_out = tp_split.kv_heads_per_rank(d.kv_heads, tp) * d.head_dim
    attention = d.hidden * q_out + 2 * d.hidden * kv_out + q_out * d.hidden
    if d.qkv_bias:
        attention += q_out + 2 * kv_out
    mlp = 3 * d.hidden * (d.intermediate // tp) * d.experts
    router = d.hidden * d.experts if d.experts > 1 else 0  # replicated
    norms = 2 * d.hidden  # replicated
    embeddings = tp_split.vocab_per_rank(d.vocab, tp) * d.hidden * (1 if d.tied_embeddings else 2)
    return d.layers * (attention + mlp + router + norms) + embeddings + d.hidden


def weight_bytes_per_gpu(d: ModelDims, tp: int, dtype: str) -> float:
    if dtype.lower() == "int8":  # the int8 layout's overhead (scales, float32 norms) shared out pro rata
        return int8_weight_bytes(d) * parameters_per_gpu(d, tp) / parameter_count(d)
    return parameters_per_gpu(d, tp) * dtype_bytes(dtype)


def kv_bytes_per_token_per_gpu(d: ModelDims, tp: int, kv_dtype: str) -> float:
    """What one GPU's KV cache spends per token: its KV heads only; the runtime's int8 cache
    stores a float32 scale with each row (``head_dim + 4`` bytes)."""
    kv_heads = tp_split.kv_heads_per_rank(d.kv_heads, tp)
    if kv_dtype.lower() == "int8":
        return 2 * d.layers * kv_heads * (d.head_dim + 4)
    return 2 * d.layers * kv_heads * d.head_dim * dtype_bytes(kv_dtype)


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine settings the KV budget depends on (``plimsoll serve``'s defaults)."""

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    block_size: int = DEFAULT_BLOCK_SIZE
    non_torch: int = NON_TORCH_BYTES_ESTIMATE  # what CUDA libraries hold outside torch (an estimate)


def activations_per_gpu(d: ModelDims, tp: int, dtype: str, engine: EngineShape) -> int:
    """``kv_memory.activation_bytes_estimate`` for this model's per-GPU shapes."""
    return int(
        activation_bytes_estimate(
            hidden=d.hidden,
            intermediate=d.intermediate // tp,
            q_dim=d.heads * d.head_dim // tp,
            kv_dim=tp_split.kv_heads_per_rank(d.kv_heads, tp) * d.head_dim,
            vocab=d.vocab,
            dtype_bytes=dtype_bytes("bf16" if dtype.lower() in ("int8", "int4", "fp8") else dtype),
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_logit_rows=engine.max_num_seqs,
        )
    )


def _draft_split(draft: ModelDims, tp: int) -> int:
    """The draft's ranks: the target's split where its heads allow it, else one (replicated)."""
    return tp if tp_split.split_error(draft.heads, draft.kv_heads, draft.intermediate, tp) is None else 1


def kv_budget(
    d: ModelDims,
    gpu_memory: int,
    tp: int,
    dtype: str,
    kv_dtype: str,
    memory_fraction: float,
    engine: EngineShape,
    draft: ModelDims | None = None,
) -> KVCacheBudget:
    """The engine's KV rule on one GPU of a ``tp``-way replica, with the weights, activations and
    outside-torch memory estimated. With a ``draft`` model its weights share the GPU and each token
    also sits in its KV cache; its steps run apart from the target's, so the larger of the two
    models' activations is the peak."""
    weights = math.ceil(weight_bytes_per_gpu(d, tp, dtype))
    per_token = math.ceil(kv_bytes_per_token_per_gpu(d, tp, kv_dtype))
    activations = activations_per_gpu(d, tp, dtype, engine)
    if draft is not None:
        dtp = _draft_split(draft, tp)
        weights += math.ceil(weight_bytes_per_gpu(draft, dtp, dtype))
        per_token += math.ceil(kv_bytes_per_token_per_gpu(draft, dtp, kv_dtype))
        activations = max(activations, activations_per_gpu(draft, dtp, dtype, engine))
    return KVCacheBudget(
        total=gpu_memory,
        utilization=memory_fraction,
        weights=weights,
        activations=activations,
        non_torch=engine.non_torch,
        bytes_per_token=per_token,
        block_size=engine.block_size,
    )


def gpus_needed(
    d: ModelDims,
    gpu_memory: int,
    dtype: str,
    kv_dtype: str,
    memory_fraction: float,
    context_length: int,
    engine: EngineShape = EngineShape(),
    draft: ModelDims | None = None,
) -> int | None:
    """The smallest tensor-parallel size (up to 64) whose weights and activations per GPU leave room
    for one full sequence."""
    for tp in range(1, 65):
        if tp_split.split_error(d.heads, d.kv_heads, d.intermediate, tp) is not None:
            continue
        if (
            kv_budget(d, gpu_memory, tp, dtype, kv_dtype, memory_fraction, engine, draft).num_tokens
            >= context_length
        ):
            return tp
    return None


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class Step:
    """One line of the plan: a quantity, its value, and how it was obtained."""

    name: str
    value: float | int | str
    how: str


def make_plan(
    dims: ModelDims,
    *,
    gpu_memory: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    memory_fraction: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    context_length: int = 4096,
    gpus_per_replica: int = 1,
    engine: EngineShape = EngineShape(),
    per_replica: float | None = None,
    per_replica_source: str | None = None,
    target_concurrency: float | None = None,
    target_rps: float | None = None,
    latency_s: float | None = None,
    draft: ModelDims | None = None,
) -> list[Step]:
    """Every step of the plan, in order; raises :class:`PlanError` on inputs that cannot work.

    ``draft`` is a speculative-decoding draft model served beside the target: its weights
    share each GPU, and every token also sits in the draft's own KV cache.
    """
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    if context_length < 1 or gpus_per_replica < 1:
        raise PlanError("--context-length and --gpus-per-replica must be at least 1")
    tp = gpus_per_replica
    kv_name = kv_dtype or dtype
    w_bytes, kv_bytes = dtype_bytes(dtype), dtype_bytes(kv_name)
    split = tp_split.split_error(dims.heads, dims.kv_heads, dims.intermediate, tp)
    if split is not None:
        raise PlanError(
            f"--gpus-per-replica {tp}: {split.replace('tensor_parallel_size', 'tensor parallel size')}"
        )
    steps: list[Step] = []
    params = parameter_count(dims)
    steps.append(Step("parameters", params, _param_how(dims)))
    if tp > 1:
        local_kv = tp_split.kv_heads_per_rank(dims.kv_heads, tp)
        kv_how = (
            f"{dims.kv_heads} KV heads split {local_kv} per GPU"
            if dims.kv_heads >= tp
            else f"{dims.kv_heads} KV heads replicated: 1 per GPU, each on {tp // dims.kv_heads} GPUs"
        )
        steps.append(
            Step(
                "tensor parallel",
                tp,
                f"{tp} GPUs per replica: {dims.heads // tp} query heads, {dims.intermediate // tp} MLP columns, "
                f"{tp_split.vocab_per_rank(dims.vocab, tp):,} vocabulary rows per GPU; {kv_how}",
            )
        )
    weights = weight_bytes_per_gpu(dims, tp, dtype)
    if tp > 1:
        how = (
            f"{parameters_per_gpu(dims, tp) / 1e9:.2f} B of the {params / 1e9:.2f} B parameters on each GPU "
            f"× {w_bytes:g} B ({dtype}) = {fmt_bytes(weights)} per GPU"
        )
    elif dtype.lower() == "int8":
        per = f"{INT8_GROUP_SIZE} inputs of each" if INT8_GROUP_SIZE else "output"
        what = "a float32 scale and offset" if INT8_OFFSETS else "a float32 scale"
        how = f"matrices × 1 B + {what} per {per} row + float32 norms/biases = {fmt_bytes(weights)}"
    else:
        how = f"{params / 1e9:.2f} B × {w_bytes:g} B ({dtype}) = {fmt_bytes(weights)}"
    steps.append(Step("weight bytes", weights, how))
    if draft is not None:
        dtp = _draft_split(draft, tp)
        draft_weights = weight_bytes_per_gpu(draft, dtp, dtype)
        where = (
            ""
            if dtp == tp
            else f", not split ({tp} ranks would split its {draft.kv_heads} KV heads unevenly)"
        )
        steps.append(
            Step(
                "draft weight bytes",
                draft_weights,
                f"draft model {parameter_count(draft) / 1e9:.2f} B × {w_bytes:g} B ({dtype}){where} "
                f"= {fmt_bytes(draft_weights)}{' per GPU' if tp > 1 else ''}",
            )
        )
        weights += draft_weights
    usable = gpu_memory * memory_fraction
    per_gpu = " per GPU" if tp > 1 else ""
    steps.append(
        Step(
            "usable memory",
            usable,
            f"{fmt_bytes(gpu_memory)} × 1 GPU × {memory_fraction:g} = {fmt_bytes(usable)}{per_gpu}",
        )
    )
    needed = gpus_needed(dims, gpu_memory, dtype, kv_name, memory_fraction, context_length, engine, draft)
    steps.append(
        Step(
            "GPUs needed",
            needed if needed is not None else "more than 64",
            "the smallest tensor-parallel split whose weights and activations per GPU leave room for one "
            f"{context_length:,}-token sequence",
        )
    )
    budget = kv_budget(dims, gpu_memory, tp, dtype, kv_name, memory_fraction, engine, draft)
    steps.append(
        Step(
            "activations",
            budget.activations,
            f"estimate for a {engine.max_num_batched_tokens:,}-token step and {engine.max_num_seqs} sampled rows "
            f"(the engine measures it at start) = {fmt_bytes(budget.activations)}{per_gpu}",
        )
    )
    steps.append(
        Step(
            "outside torch",
            budget.non_torch,
            f"CUDA libraries' workspaces, estimate = {fmt_bytes(budget.non_torch)}",
        )
    )
    if budget.kv_bytes <= 0:
        fix = (
            f"at least {needed} GPUs per replica (--gpus-per-replica {needed})"
            if needed
            else "more GPUs per replica"
        )
        raise PlanError(
            f"the weights ({fmt_bytes(weights)}{per_gpu}) and activations ({fmt_bytes(budget.activations)}) do not "
            f"fit in {fmt_bytes(usable)}; use {fix}, a smaller --dtype, or a larger --memory-fraction"
        )
    steps.append(
        Step(
            "KV budget",
            budget.kv_bytes,
            f"{fmt_bytes(usable)} − {fmt_bytes(weights)} − {fmt_bytes(budget.activations)} − "
            f"{fmt_bytes(budget.non_torch)} = {fmt_bytes(budget.kv_bytes)}{per_gpu}",
        )
    )
    per_token = kv_bytes_per_token_per_gpu(dims, tp, kv_name)
    kv_heads = tp_split.kv_heads_per_rank(dims.kv_heads, tp)
    how = (
        f"2 × {dims.layers} layers × {kv_heads} KV heads{per_gpu} × {dims.head_dim} head dim × {kv_bytes:g} B "
        f"({kv_name}) = {per_token:,.0f} B{per_gpu}"
    )
    if kv_name.lower() == "int8":  # the runtime's int8 cache keeps a float32 scale per row
        how = (
            f"2 × {dims.layers} layers × {kv_heads} KV heads{per_gpu} × ({dims.head_dim} int8 + a 4 B scale) "
            f"= {per_token:,.0f} B{per_gpu}"
        )
    if draft is not None:
        dtp = _draft_split(draft, tp)
        draft_token = kv_bytes_per_token_per_gpu(draft, dtp, kv_name)
        how += (
            f" + the draft's 2 × {draft.layers} layers × {tp_split.kv_heads_per_rank(draft.kv_heads, dtp)} KV heads × "
            f"{draft.head_dim} head dim × {kv_bytes:g} B = {per_token + draft_token:,.0f} B{per_gpu} (each token sits "
            "in both caches)"
        )
        per_token += draft_token
    steps.append(Step("KV bytes per token", per_token, how))
    tokens = budget.num_tokens
    steps.append(
        Step(
            "KV tokens that fit",
            tokens,
            f"floor({budget.kv_bytes:,} B / ({budget.bytes_per_token:,} B × {engine.block_size})) = "
            f"{budget.num_blocks:,} whole blocks × {engine.block_size} = {tokens:,}",
        )
    )
    if dims.max_position is not None and context_length > dims.max_position:
        raise PlanError(
            f"--context-length {context_length} exceeds the model's max_position_embeddings "
            f"{dims.max_position}"
        )
    sequences = tokens // context_length
    steps.append(
        Step(
            "sequences at full context",
            sequences,
            (f"floor({tokens:,} / {context_length:,} tokens) = {sequences:,} per replica"),
        )
    )

    if target_concurrency is None and target_rps is None:
        return steps
    if target_concurrency is not None and target_rps is not None:
        raise PlanError("give --target-concurrency or --target-rps, not both")
    if target_rps is not None:
        if latency_s is None:
            raise PlanError("--target-rps needs --latency-s (mean seconds per request) for Little's law")
        load = target_rps * latency_s
        steps.append(
            Step(
                "target in flight", load, (f"Little's law: {target_rps:g} req/s × {latency_s:g} s = {load:g}")
            )
        )
    else:
        assert target_concurrency is not None
        load = target_concurrency
        steps.append(Step("target in flight", load, f"{load:g} concurrent requests"))
    if per_replica is None:
        per_replica, per_replica_source = float(sequences), "KV capacity at full context (no bench report)"
        steps.append(
            Step(
                "note",
                "",
                "sized by KV room alone, ignoring latency: each replica is assumed to hold every sequence "
                "that fits; give --report (a `plimsoll bench sweep` of this model) to size by its knee",
            )
        )
    if per_replica <= 0:
        raise PlanError(f"per-replica concurrency is {per_replica:g}; nothing fits at this context length")
    steps.append(Step("per-replica concurrency", per_replica, per_replica_source or "given"))
    if per_replica > sequences:
        steps.append(
            Step(
                "note",
                "",
                (
                    f"per-replica concurrency {per_replica:g} exceeds the {sequences} sequences that fit at full "
                    "context; it holds only if requests are shorter than --context-length"
                ),
            )
        )
    replicas = math.ceil(load / per_replica)
    steps.append(Step("replicas", replicas, f"ceil({load:g} / {per_replica:g}) = {replicas}"))
    gpus = replicas * gpus_per_replica
    steps.append(Step("GPUs", gpus, f"{replicas} replicas × {gpus_per_replica} GPU = {gpus}"))
    return steps


def _param_how(d: ModelDims) -> str:
    attention = f"{d.heads}q/{d.kv_heads}kv heads × {d.head_dim}"
    mlp = f"MLP {d.intermediate}" + (f" × {d.experts} experts" if d.experts > 1 else "")
    emb = "tied" if d.tied_embeddings else "untied"
    return f"{d.layers} layers × (attention {attention}, {mlp}), hidden {d.hidden}, vocab {d.vocab} ({emb})"


def _name_tokens(text: str) -> set[str]:
    # "HuggingFaceTB/SmolLM2-135M-Instruct" -> {"huggingfacetb", "smollm2", "135m", "instruct"}
    return {t for t in re.split(r"[^a-z0-9]+", text.lower()) if len(t) >= 3 and not t.isdigit()}


def _other_model(report: Path, model_config: Path) -> str | None:
    """A warning when the report was measured on another model than the config describes, else None."""
    try:
        measured = str(json.loads(report.read_text())["server"]["model"])
        config_file = model_config / "config.json" if model_config.is_dir() else model_config
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable inputs get their own errors below
    names = [
        model_config.stem if model_config.is_file() else model_config.name,
        str(cfg.get("_name_or_path", "")),
    ]
    config_tokens = set().union(*(_name_tokens(n) for n in names))
    if _name_tokens(measured) & config_tokens:
        return None
    return (
        f"the report measured {measured!r} but the config is {names[0]!r} ({cfg.get('model_type', '?')}); "
        "its per-replica figure holds only for the model it measured: sweep this model, or pass "
        "--concurrency-per-replica"
    )


def _report_target(
    report: Path, ttft_p95_ms: float | None, tpot_p50_ms: float | None, headroom: float | None
) -> tuple[float, str, float | None]:
    """Per-replica concurrency (and the mean latency there) from a bench report, for this SLO."""
    from plimsoll.operator.scaling.profile import read_profile_file

    try:
        profile = read_profile_file(report)
    except ValueError as err:
        raise PlanError(str(err)) from None
    try:
        value, how = profile.concurrency_for(
            ttft_p95_ms=ttft_p95_ms, tpot_p50_ms=tpot_p50_ms, headroom=headroom
        )
    except ValueError as err:
        raise PlanError(f"{report}: {err}") from None
    return float(value), how, profile.mean_latency_s(value)


def plan(
    model_config: Annotated[Path, typer.Option(help="A model's config.json, or the directory holding it.")],
    gpu_memory: Annotated[str, typer.Option(help="Memory of one GPU, e.g. 80GiB or 80GB.")],
    dtype: Annotated[str, typer.Option(help="Weight dtype: bf16, fp16, fp32, fp8, int8, int4.")] = "bf16",
    kv_dtype: Annotated[str | None, typer.Option(help="KV-cache dtype (default: the weight dtype).")] = None,
    memory_fraction: Annotated[
        float,
        typer.Option(
            "--memory-fraction",
            "--gpu-memory-utilization",
            help="Share of GPU memory the engine may use (`plimsoll serve --gpu-memory-utilization`).",
        ),
    ] = DEFAULT_GPU_MEMORY_UTILIZATION,
    context_length: Annotated[int, typer.Option(help="Tokens per sequence (prompt + output).")] = 4096,
    gpus_per_replica: Annotated[
        int,
        typer.Option(
            "--gpus-per-replica",
            "--tensor-parallel-size",
            "-tp",
            help="GPUs per replica, one tensor-parallel rank each: figures become per GPU.",
        ),
    ] = 1,
    report: Annotated[Path | None, typer.Option(help="A `plimsoll bench sweep` JSON report.")] = None,
    concurrency_per_replica: Annotated[
        float | None, typer.Option(help="Per-replica concurrency, instead of a report.")
    ] = None,
    target_concurrency: Annotated[float | None, typer.Option(help="Concurrent requests to serve.")] = None,
    target_rps: Annotated[float | None, typer.Option(help="Requests per second to serve.")] = None,
    latency_s: Annotated[
        float | None,
        typer.Option(
            help="Mean seconds per request for --target-rps (default: the report's, at the target)."
        ),
    ] = None,
    ttft_p95_ms: Annotated[
        float | None, typer.Option(help="TTFT p95 SLO to re-derive the target from the report.")
    ] = None,
    tpot_p50_ms: Annotated[
        float | None, typer.Option(help="TPOT p50 SLO to re-derive the target from the report.")
    ] = None,
    headroom: Annotated[
        float | None, typer.Option(help="Share of the knee to load each replica to (0-1].")
    ] = None,
    link_bandwidth: Annotated[
        str | None,
        typer.Option(
            help="KV link between replicas (e.g. 25GB/s, 400Gbps): with --report, predict prefill/decode "
            "disaggregation (goodput per replica aggregated and split, and the verdict)."
        ),
    ] = None,
    pd_ratios: Annotated[str, typer.Option(help="Split layouts to predict, PREFILL:DECODE.")] = "1:1,1:2,2:1",
    pd_transfer_cpu_ms: Annotated[
        str | None,
        typer.Option(
            help="PRODUCER,CONSUMER: CPU milliseconds one request's KV transfer takes the prefill and the decode "
            "replica (`plimsoll bench disagg`'s KV CPU ms/req P/D), for replicas whose own cores move the blocks "
            "(CPU serving); charged to their compute. Without it GPU replicas' copy engine moves them for free."
        ),
    ] = None,
    pd_input_tokens: Annotated[
        float | None,
        typer.Option(help="Prompt tokens per request for the prediction (default: the report's)."),
    ] = None,
    pd_output_tokens: Annotated[
        float | None,
        typer.Option(help="Output tokens per request for the prediction (default: the report's)."),
    ] = None,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="The engine's --max-num-batched-tokens (its largest step).")
    ] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: Annotated[
        int, typer.Option(min=1, help="The engine's --max-num-seqs.")
    ] = DEFAULT_MAX_NUM_SEQS,
    block_size: Annotated[int, typer.Option(min=1, help="The engine's --block-size.")] = DEFAULT_BLOCK_SIZE,
    draft_model_config: Annotated[
        Path | None,
        typer.Option(
            help="A speculative-decoding draft model's config.json: its weights and KV cache share each GPU."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan capacity offline: what fits on one GPU replica, and how many replicas a load needs."""
    split_verdict = None
    try:
        if report is not None and concurrency_per_replica is not None:
            raise PlanError("give --report or --concurrency-per-replica, not both")
        if report is None and (ttft_p95_ms is not None or tpot_p50_ms is not None or headroom is not None):
            raise PlanError(
                "--ttft-p95-ms, --tpot-p50-ms and --headroom re-derive the target from --report; give one"
            )
        if re.fullmatch(r"\s*[0-9]+(\.[0-9]+)?\s*", gpu_memory):
            raise PlanError(
                f"--gpu-memory {gpu_memory.strip()} has no unit; write {gpu_memory.strip()}GiB or {gpu_memory.strip()}GB"
            )
        per_replica, source = concurrency_per_replica, "--concurrency-per-replica"
        if report is not None:
            mismatch = _other_model(report, model_config)
            if mismatch is not None:
                typer.echo(f"plimsoll plan: WARNING: {mismatch}", err=True)
                source += f" — WARNING: {mismatch}"
            per_replica, source, report_latency = _report_target(report, ttft_p95_ms, tpot_p50_ms, headroom)
            if latency_s is None and target_rps is not None and report_latency is not None:
                latency_s = report_latency
                source += f"; mean E2E there {report_latency:.3g} s (report)"
        steps = make_plan(
            read_model_config(model_config),
            gpu_memory=memory_size(gpu_memory),
            dtype=dtype,
            kv_dtype=kv_dtype,
            memory_fraction=memory_fraction,
            context_length=context_length,
            gpus_per_replica=gpus_per_replica,
            engine=EngineShape(max_num_batched_tokens, max_num_seqs, block_size),
            per_replica=per_replica,
            per_replica_source=source,
            target_concurrency=target_concurrency,
            target_rps=target_rps,
            latency_s=latency_s,
            draft=read_model_config(draft_model_config) if draft_model_config is not None else None,
        )
        if link_bandwidth is not None:
            if report is None:
                raise PlanError(
                    "--link-bandwidth predicts a split from a profile: give --report (a bench sweep)"
                )
            kv_name = kv_dtype or dtype
            split_verdict = _split_prediction(
                report, kv_bytes_per_token_per_gpu(read_model_config(model_config), 1, kv_name), link_bandwidth,
                pd_ratios, pd_input_tokens, pd_output_tokens, ttft_p95_ms, tpot_p50_ms,
                _transfer_cpu(pd_transfer_cpu_ms), block_size,
            )  # fmt: skip
        elif pd_transfer_cpu_ms is not None:
            raise PlanError("--pd-transfer-cpu-ms is used by the split prediction: give --link-bandwidth too")
    except PlanError as err:
        typer.echo(f"plimsoll plan: {err}", err=True)
        raise typer.Exit(code=2) from None
    if as_json:
        body: dict[str, Any] = {"model_config": str(model_config), "steps": [asdict(s) for s in steps]}
        if split_verdict is not None:
            body["disaggregation"] = split_verdict.to_dict()
        typer.echo(json.dumps(body, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plimsoll plan: {model_config.name} on {gpu_memory} × {gpus_per_replica}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("arithmetic")
    for s in steps:
        value: object = s.value
        if s.name == "KV bytes per token":
            value = f"{s.value:,.0f} B"
        elif isinstance(s.value, int | float) and (
            "bytes" in s.name or s.name in ("usable memory", "KV budget", "activations", "outside torch")
        ):
            value = fmt_bytes(s.value)
        elif isinstance(s.value, int):
            value = f"{s.value:,}"
        elif isinstance(s.value, float):
            value = f"{s.value:g}"
        table.add_row(s.name, str(value), s.how)
    Console().print(table)
    typer.echo(llmservice_resources_line(gpus_per_replica))
    if split_verdict is not None:
        for line in split_lines(split_verdict):
            typer.echo(line)


def _transfer_cpu(text: str | None) -> tuple[float, float] | None:
    """``--pd-transfer-cpu-ms 4.2,6.8`` -> (producer, consumer) seconds; PlanError saying how to write it."""
    if text is None:
        return None
    try:
        producer, consumer = (float(part) / 1e3 for part in text.split(","))
    except ValueError:
        raise PlanError(
            f"--pd-transfer-cpu-ms {text!r}: write PRODUCER,CONSUMER milliseconds, e.g. 4.2,6.8"
        ) from None
    if min(producer, consumer) < 0 or not math.isfinite(producer + consumer):
        raise PlanError(f"--pd-transfer-cpu-ms {text!r}: CPU milliseconds are zero or more")
    return producer, consumer


def _split_prediction(
    report: Path, kv_bytes_per_token: float, link: str, ratios: str, input_tokens: float | None,
    output_tokens: float | None, ttft_p95_ms: float | None, tpot_p50_ms: float | None,
    transfer_cpu_s: tuple[float, float] | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
) -> Any:  # fmt: skip
    """The predicted verdict on splitting prefill and decode (``plimsoll.disaggregation``); with
    ``transfer_cpu_s`` (measured on CPU replicas) each transfer's CPU time is charged to its two replicas."""
    from plimsoll import disaggregation as pd

    try:
        data = json.loads(report.read_text())
        profile = pd.profile_from_report(
            data, kv_bytes_per_token, tpot_p50_ms / 1e3 if tpot_p50_ms else None, block_size
        )
        first = next(lv for lv in data["levels"] if lv.get("valid"))
        isl = input_tokens or (first.get("tokens") or {}).get("prompt_mean")
        osl = output_tokens or (first.get("tokens") or {}).get("output_mean")
        if not isl or not osl:
            raise ValueError("the report has no token counts; give --pd-input-tokens and --pd-output-tokens")
        layouts = pd.predict(
            profile, float(isl), float(osl), pd.parse_bandwidth(link), pd.parse_ratios(ratios),
            ttft_slo_s=ttft_p95_ms / 1e3 if ttft_p95_ms else None, tpot_slo_s=tpot_p50_ms / 1e3 if tpot_p50_ms else None,
            pull_stall=1.0 if transfer_cpu_s is not None else 0.0, transfer_cpu_s=transfer_cpu_s,
        )  # fmt: skip
        verdict = pd.verdict(layouts)
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        raise PlanError(f"cannot predict a prefill/decode split from {report}: {exc}") from None
    verdict.reasons.insert(
        0,
        f"profile: prefill {profile.prefill_tokens_per_s:,.0f} tokens/s, {profile.decode_sequences:g} sequences "
        f"at TPOT {profile.decode_tpot_s * 1e3:.0f} ms, {kv_bytes_per_token:,.0f} KV bytes per token, "
        f"{profile.request_overhead_s * 1e3:.1f} ms a request outside prefill and decode (twice for a split "
        f"request); "
        f"{float(isl):.0f} prompt and {float(osl):.0f} output tokens per request; link {link}; the transfer "
        + (f"charged to the replicas' compute at its measured CPU time ({transfer_cpu_s[0] * 1e3:g} ms prefill "
           f"side, {transfer_cpu_s[1] * 1e3:g} ms decode side)" if transfer_cpu_s is not None
           else "not charged to the replicas' compute (a GPU's copy engine moves the blocks)"),
    )  # fmt: skip
    return verdict


def split_lines(verdict: Any) -> list[str]:
    """The predicted verdict as plain lines."""
    lines = [
        f"prefill/decode split (predicted at the profiled concurrencies): run {verdict.runs} ({verdict.category})"
    ]
    return lines + [f"  - {reason}" for reason in verdict.reasons]


def llmservice_resources_line(gpus_per_replica: int) -> str:
    """How the plan's GPUs per replica are asked for in an LLMService (the operator's side)."""
    if gpus_per_replica == 1:
        return "LLMService: resources.gpu.count: 1 (one GPU per replica, no tensor parallelism)"
    return (
        f"LLMService: resources.gpu.count: {gpus_per_replica} (the operator requests {gpus_per_replica} GPUs "
        f"per pod and passes --tensor-parallel-size {gpus_per_replica}; override with "
        "engine.tensorParallelSize)"
    )
