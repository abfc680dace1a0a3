"""Tensor parallelism applied to a built Llama-family model: each rank keeps its slice, hooks sum.

What it is: ``shard_model(net, group)`` cuts one rank's share out of a loaded
``LlamaForCausalLM`` in place, Megatron-style: q/k/v and gate/up are column-parallel
(this rank's attention heads and MLP columns), o_proj and down_proj row-parallel
(their input columns; a forward hook all-reduces the partial sums, and only rank 0
keeps their bias, so it is added once), the embedding vocabulary-parallel (rows of
this rank's vocabulary range, zeros elsewhere, all-reduced) and the LM head
vocabulary-parallel too (a hook gathers the logits on rank 0). The vocabulary is
padded up to a multiple of the rank count; the padding is cut off the gathered logits.
KV heads: with at least as many KV heads as ranks each rank keeps
``num_kv_heads / tp`` of them; with fewer (GQA, e.g. 2 KV heads on 4 ranks) each
KV head is replicated on ``tp / num_kv_heads`` ranks, the ranks whose query heads
read it. ``check_tensor_parallel`` says which shapes cannot split, before anything loads.

``read_rank_state(directory, config, group)`` reads only this rank's share of each tensor of a
safetensors checkpoint (``safe_open(...).get_slice``), by the same slicing rules, so no rank
holds the whole checkpoint in memory: the loader then runs ``shard_model`` on the model while
it is still on the meta device (which only reshapes it and installs the hooks) and assigns the
rank's tensors into it.

What it is not: communication (``distributed/group.py``), process management
(``engine/tp_executor.py``) or int8 weights (refused with TP by ``EngineConfig``).
"""

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plimsoll import tp_split
from plimsoll.runtime.distributed.group import TensorParallelGroup
from plimsoll.runtime.models.dense import Linear
from plimsoll.runtime.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM


def _heads(config: Any) -> tuple[int, int, int]:
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(config.num_key_value_heads or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    return num_heads, num_kv_heads, head_dim


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Raise ``ValueError`` saying why ``config`` cannot be split over ``tp`` ranks (None if it can)."""
    num_heads, num_kv_heads, _ = _heads(config)
    error = tp_split.split_error(num_heads, num_kv_heads, int(config.intermediate_size), tp)
    if error is not None:
        raise ValueError(error)


def kv_heads_per_rank(config: Any, tp: int) -> int:
    """KV heads each rank caches: its share, or one replicated head when there are fewer than ranks."""
    return tp_split.kv_heads_per_rank(_heads(config)[1], tp)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _set_linear(layer: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    layer.weight = _param(weight)
    layer.bias = None if bias is None else _param(bias)  # type: ignore[assignment]  # nn.Linear's bias is Optional
    layer.out_features, layer.in_features = weight.shape


def part_rows(part: str, config: Any, rank: int, tp: int) -> slice:
    """This rank's rows of one Hugging Face projection (``q``, ``k``, ``v``, ``gate``, ``up``), or
    its input columns of a row-parallel one (``o`` reads ``q``'s, ``down`` reads ``gate``'s)."""
    num_heads, num_kv_heads, head_dim = _heads(config)
    if part in ("q", "o"):
        local_heads = num_heads // tp
        return slice(rank * local_heads * head_dim, (rank + 1) * local_heads * head_dim)
    if part in ("k", "v"):
        local_kv = tp_split.kv_heads_per_rank(num_kv_heads, tp)
        # Split: this rank's share; replicated: the one KV head this rank's query heads read.
        first_kv = rank * local_kv if num_kv_heads >= tp else rank * num_kv_heads // tp
        return slice(first_kv * head_dim, (first_kv + local_kv) * head_dim)
    if part in ("gate", "up", "down"):
        local = int(config.intermediate_size) // tp
        return slice(rank * local, (rank + 1) * local)
    raise ValueError(f"no tensor-parallel rule for projection part {part!r}")


def _shard_attention(attn: Attention, config: Any, group: TensorParallelGroup) -> None:
    tp, rank = group.world_size, group.rank
    num_heads, num_kv_heads, head_dim = _heads(config)
    local_heads = num_heads // tp
    local_kv = tp_split.kv_heads_per_rank(num_kv_heads, tp)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim

    def rows(t: torch.Tensor) -> torch.Tensor:  # [q | k | v] -> this rank's [q | k | v]
        q, k, v = torch.split(t, [q_size, kv_size, kv_size])
        return torch.cat(tuple(x[part_rows(p, config, rank, tp)] for x, p in ((q, "q"), (k, "k"), (v, "v"))))

    qkv = attn.qkv_proj
    _set_linear(qkv, rows(qkv.weight.data), None if qkv.bias is None else rows(qkv.bias.data))
    o = attn.o_proj
    _row_parallel(o, o.weight.data[:, part_rows("o", config, rank, tp)], group)
    attn.num_heads, attn.num_kv_heads = local_heads, local_kv
    attn.q_size, attn.kv_size = local_heads * head_dim, local_kv * head_dim


def _shard_mlp(mlp: MLP, group: TensorParallelGroup) -> None:
    tp, rank = group.world_size, group.rank
    size = mlp.intermediate_size
    local = size // tp
    gate_up = mlp.gate_up_proj

    def rows(t: torch.Tensor) -> torch.Tensor:  # [gate | up] -> this rank's [gate | up]
        return torch.cat(
            (t[rank * local : (rank + 1) * local], t[size + rank * local : size + (rank + 1) * local])
        )

    _set_linear(gate_up, rows(gate_up.weight.data), None if gate_up.bias is None else rows(gate_up.bias.data))
    down = mlp.down_proj
    _row_parallel(down, down.weight.data[:, rank * local : (rank + 1) * local], group)
    mlp.intermediate_size = local


def _row_parallel(layer: nn.Linear, weight: torch.Tensor, group: TensorParallelGroup) -> None:
    """Keep this rank's input columns; the output is a partial sum, all-reduced by a hook."""
    bias = layer.bias.data if layer.bias is not None and group.is_first else None
    _set_linear(layer, weight, bias)

    def all_reduce(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        group.all_reduce(output)

    layer.register_forward_hook(all_reduce)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[first, first + rows)`` of the embedding; other ids look up zeros, then all-reduce."""

    def __init__(self, weight: torch.Tensor, first: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = _param(weight)  # [V / tp (padded), hidden]
        self.first = first
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        self.group.all_reduce(out)
        return out


def _vocab_rows(weight: torch.Tensor, group: TensorParallelGroup) -> tuple[torch.Tensor, int]:
    """This rank's rows of a ``[V, hidden]`` matrix, zero-padded to ``ceil(V / tp)``, and its first id."""
    per_rank = tp_split.vocab_per_rank(weight.shape[0], group.world_size)
    first = group.rank * per_rank
    part = weight[first : first + per_rank]
    if part.shape[0] < per_rank:
        part = torch.cat((part, part.new_zeros(per_rank - part.shape[0], weight.shape[1])))
    return part, first


def shard_model(net: LlamaForCausalLM, group: TensorParallelGroup) -> LlamaForCausalLM:
    """Keep this rank's share of ``net`` (a ``LlamaForCausalLM``), in place; see the module docstring."""
    config = net.config
    check_tensor_parallel(config, group.world_size)
    decoder = net.model
    for layer in decoder.layers:
        assert isinstance(layer, DecoderLayer)
        _shard_attention(layer.self_attn, config, group)
        _shard_mlp(layer.mlp, group)
    vocab = int(config.vocab_size)
    embed_rows, first = _vocab_rows(decoder.embed_tokens.weight.data, group)
    embedding = VocabParallelEmbedding(embed_rows, first, group)
    decoder.add_module("embed_tokens", embedding)  # same forward contract as nn.Embedding
    if net.tie_word_embeddings:
        head = Linear(embed_rows.shape[1], embed_rows.shape[0], bias=False, device="meta")
        head.weight = embedding.weight  # tied: the same shard serves both
        net.lm_head = head
        net.tie_word_embeddings = False
    else:
        head_rows, _ = _vocab_rows(net.lm_head.weight.data, group)
        _set_linear(net.lm_head, head_rows, None)

    def gather_logits(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        gathered: torch.Tensor = group.gather_last_dim(output)[..., :vocab]  # [S, V] on rank 0
        return gathered

    net.lm_head.register_forward_hook(gather_logits)
    return net


# Hugging Face tensor name -> (projection part, sliced along the input columns, bias kept on rank 0 only)
_HF_PARTS = {
    "q_proj": ("q", False),
    "k_proj": ("k", False),
    "v_proj": ("v", False),
    "gate_proj": ("gate", False),
    "up_proj": ("up", False),
    "o_proj": ("o", True),
    "down_proj": ("down", True),
}


def read_rank_state(directory: Any, config: Any, group: TensorParallelGroup) -> dict[str, torch.Tensor]:
    """This rank's share of every tensor of the safetensors files in ``directory`` (Hugging Face
    names): column-parallel rows, row-parallel input columns (their bias on rank 0 only), this
    rank's vocabulary rows of the embedding and the head (zero-padded as ``shard_model`` pads
    them), everything else whole. Only those slices are read into memory."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {directory}; save the model with safe_serialization")
    tp, rank = group.world_size, group.rank
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                tensor = _read_share(reader, name, config, rank, tp)
                if tensor is not None:
                    state[name] = tensor
    return state


def _read_share(reader: Any, name: str, config: Any, rank: int, tp: int) -> torch.Tensor | None:
    view = reader.get_slice(name)  # safetensors' slice: indexing reads just those rows or columns
    module, _, kind = name.rpartition(".")
    share: torch.Tensor | None
    projection = module.rpartition(".")[2]
    if projection in _HF_PARTS:
        part, by_columns = _HF_PARTS[projection]
        rows = part_rows(part, config, rank, tp)
        if kind == "bias" and by_columns:
            share = view[:] if rank == 0 else None  # added once, after the all-reduce
        else:
            share = view[:, rows] if by_columns and kind == "weight" else view[rows]
        return share
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = view.get_shape()[0]
        per_rank = tp_split.vocab_per_rank(vocab, tp)
        first = rank * per_rank
        vocab_rows: torch.Tensor = view[first : min(vocab, first + per_rank)]
        if vocab_rows.shape[0] < per_rank:
            padding = vocab_rows.new_zeros(per_rank - vocab_rows.shape[0], vocab_rows.shape[1])
            vocab_rows = torch.cat((vocab_rows, padding))
        return vocab_rows
    share = view[:]
    return share
