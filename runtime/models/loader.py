"""Loads a model, its tokenizer and its stop tokens from a HF directory, a GGUF file or a name.

What it is: path resolution (``smollm2-135m`` → the embedded model), config and
tokenizer read directly where the files are the plain kind (``model_config.py``,
``tokenizer.py``: a replica that needs nothing more never imports transformers, seconds of
its start) and through transformers otherwise, weights from safetensors (or through
transformers' GGUF support for ``.gguf``), and the checks that turn unsupported models into
clear errors. What it is not: a downloader; nothing here talks to a hub.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from plimsoll.runtime.models.llama import LlamaForCausalLM, check_architecture, fuse_hf_state_dict

if TYPE_CHECKING:
    from plimsoll.runtime.distributed.group import TensorParallelGroup
    from plimsoll.runtime.models.weight_cache import WeightCache


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    path: Path
    max_position_embeddings: int
    # With a weight cache that missed and ``defer_store``: writes the weights to it (the caller runs
    # it when the first answer no longer waits on it).
    store_weights: Callable[[], object] | None = None


def resolve_model_path(model: str) -> tuple[Path, str | None]:
    """Return ``(directory, gguf file name or None)``."""
    from plimsoll.runtime.models import embedded

    if model in embedded.EMBEDDED_MODELS:
        return embedded.ensure_embedded_model(model), None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return path, ggufs[0].name
            raise ValueError(
                f"{path} has no config.json; pass a Hugging Face model directory or a .gguf file"
            )
        return path, None
    raise ValueError(
        f"model {model!r} is neither a directory, a .gguf file, nor an embedded model name "
        f"({', '.join(embedded.EMBEDDED_MODELS)}); nothing is downloaded from a hub"
    )


def read_hf_config(model: str) -> Any:
    """The model's config alone (no weights, no tokenizer)."""
    return _hf_config(*resolve_model_path(model))


def _hf_config(directory: Path, gguf_file: str | None) -> Any:
    from plimsoll.runtime.models.model_config import read_llama_config

    return _without_transformers(directory, gguf_file, read_llama_config, "AutoConfig")


def _tokenizer(directory: Path, gguf_file: str | None) -> Any:
    from plimsoll.runtime.models.tokenizer import load_tokenizer

    return _without_transformers(directory, gguf_file, load_tokenizer, "AutoTokenizer")


def _without_transformers(directory: Path, gguf_file: str | None, read: Callable[[Path], Any], auto: str) -> Any:
    """``read(directory)`` where it reads the files (plain files, no GGUF), else transformers' ``auto`` class:
    importing transformers is the largest part of a replica's start."""
    fast = None if gguf_file else read(directory)
    if fast is not None:
        return fast
    import transformers

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return getattr(transformers, auto).from_pretrained(str(directory), **extra)


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {directory}; save the model with safe_serialization")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _eos_token_ids(directory: Path, gguf_file: str | None, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    if gguf_file:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(str(directory), gguf_file=gguf_file).eos_token_id
        except (OSError, ValueError, TypeError):
            eos = getattr(hf_config, "eos_token_id", None)
    else:
        from plimsoll.runtime.models.tokenizer import read_generation_config

        # generation_config.json's eos_token_id wins over config.json's, as in transformers.
        generation = read_generation_config(directory)
        eos = generation.get("eos_token_id") if generation is not None else getattr(hf_config, "eos_token_id", None)
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None:
            ids.add(int(value))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


WEIGHT_ALIGNMENT = 64  # bytes: a cache line, and one AVX-512 vector


def realign_weights(net: torch.nn.Module) -> int:
    """Copy every CPU parameter and buffer whose data does not start on a 64-byte boundary (or
    that is a view into a larger storage, which it would keep alive) into a fresh, aligned
    allocation; returns how many moved.

    A safetensors file places tensors back to back after its header, 8-byte aligned, and
    ``load_file`` gives each its own storage at that alignment, so most weights kept as loaded
    start mid cache line (the embedding, ``o_proj`` and ``down_proj`` of SmolLM2 at offset 40):
    every vector load of such a matrix straddles two lines, and the compiled kernels streamed
    them 1.35-1.5x slower at 16 rows (measured on the 2-core CI host). Fused projections are new
    tensors (``torch.cat``) and already aligned.
    """
    fresh: dict[int, torch.Tensor] = {}  # id of a tensor -> its copy: a weight shared by two modules stays shared
    for module in net.modules():
        # Parameters are copied as Parameters (below), so both tables take what ``fresh`` holds.
        for table in (cast(dict[str, torch.Tensor | None], module._parameters), module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu":
                    continue
                # A view into a larger storage (a shard cut from a full matrix, say) is copied too,
                # aligned or not, so that it does not keep the rest alive beside the copy.
                view = t.untyped_storage().nbytes() != t.numel() * t.element_size()
                if t.data_ptr() % WEIGHT_ALIGNMENT == 0 and not view:
                    continue
                if id(t) not in fresh:
                    copy = t.detach().clone(memory_format=torch.contiguous_format)
                    fresh[id(t)] = (
                        torch.nn.Parameter(copy, requires_grad=t.requires_grad)
                        if isinstance(t, torch.nn.Parameter)
                        else copy
                    )
                table[name] = fresh[id(t)]
    return len(fresh)


def share_tied_int8_head(net: torch.nn.Module) -> None:
    """Point a tied int8 head back at the embedding's int8 matrix, scales and offsets.

    ``quantize_model`` gives both modules the same tensors, but ``Module.to(device)`` copies every
    module's buffers separately, so on a GPU a tied head would hold a second copy of the
    vocabulary matrix.
    """
    head, embed = net.lm_head, net.model.embed_tokens  # type: ignore[union-attr]
    for name in ("qweight", "scales", "offsets"):
        head._buffers[name] = embed._buffers[name]  # type: ignore[union-attr]


def checkpoint_fingerprint(
    directory: Path, gguf_file: str | None, dtype: torch.dtype, quantization: str | None, rank: str
) -> str:
    """What identifies the weights a load produces: the checkpoint's files (names, sizes,
    modification times), the dtype, the quantization and the tensor-parallel rank. Caches of
    things computed from the weights (models/panel_cache.py) are keyed by it."""
    files = [directory / gguf_file] if gguf_file else sorted(directory.glob("*.safetensors"))
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return repr((str(directory.resolve()), stats, str(dtype), quantization, rank))


def _cacheable(
    gguf_file: str | None,
    hf_config: Any,
    device: str | torch.device,
    quantization: str | None,
    tensor_parallel: "TensorParallelGroup | None",
) -> bool:
    """Whether the weights as served are the checkpoint's tensors fused and cast, nothing more: what
    the weight cache keeps (not GGUF, quantized or FP8 weights, shards, or an accelerator's copy)."""
    return (
        gguf_file is None
        and quantization is None
        and getattr(hf_config, "quantization_config", None) is None
        and (tensor_parallel is None or tensor_parallel.world_size == 1)
        and torch.device(device).type == "cpu"
    )


def _mapped_model(
    hf_config: Any, dtype: torch.dtype, cache: "WeightCache", fingerprint: str
) -> LlamaForCausalLM | None:
    """The model with every weight mapped from the cache's file, or ``None`` when it holds none for it."""
    from plimsoll.runtime.models.llama import RotaryEmbedding

    with torch.device("meta"):
        net = LlamaForCausalLM(hf_config)
    expected = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    state = cache.load(fingerprint, expected)
    if state is None or any(t.dtype != dtype for t in state.values() if t.is_floating_point()):
        return None
    net.load_state_dict(state, strict=True, assign=True)
    net.model.rotary_emb = RotaryEmbedding(hf_config)  # float32, as load_model keeps it
    net.eval()
    net.checkpoint_fingerprint = fingerprint
    net.weights_mapped = True
    return net


def load_model(
    model: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    tensor_parallel: "TensorParallelGroup | None" = None,
    weight_cache: "WeightCache | None" = None,
    defer_store: bool = False,
) -> LoadedModel:
    """Load ``model``; with ``tensor_parallel``, keep only that rank's shard (before the copy to ``device``).
    With ``weight_cache``, a CPU model of plain weights is mapped from the cache's file when it holds
    this checkpoint's, and written there after loading when it does not (``weight_cache.py``); with
    ``defer_store`` that write is left to the caller (``LoadedModel.store_weights``)."""
    directory, gguf_file = resolve_model_path(model)
    hf_config = _hf_config(directory, gguf_file)
    check_architecture(hf_config)
    tokenizer = _tokenizer(directory, gguf_file)
    if not _cacheable(gguf_file, hf_config, device, quantization, tensor_parallel):
        weight_cache = None
    if weight_cache is not None:  # one rank, unquantized: the fingerprint the model gets below
        fingerprint = checkpoint_fingerprint(directory, gguf_file, dtype, quantization, "0/1")
        mapped = _mapped_model(hf_config, dtype, weight_cache, fingerprint)
        if mapped is not None:
            return _loaded(mapped, hf_config, tokenizer, directory, gguf_file)
    if gguf_file:
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(
            str(directory), gguf_file=gguf_file, dtype=torch.float32
        ).state_dict()
    # With tensor parallelism each rank reads only its share of each tensor, and the model is
    # sharded while still on the meta device (models/tensor_parallel.py).
    presharded = gguf_file is None and tensor_parallel is not None and tensor_parallel.world_size > 1
    if presharded and tensor_parallel is not None:
        from plimsoll.runtime.models.tensor_parallel import read_rank_state

        state = read_rank_state(directory, hf_config, tensor_parallel)
    elif not gguf_file:
        state = _read_safetensors(directory)
    from plimsoll.runtime.models import quant_fp8

    # An FP8 checkpoint (quantization_config in config.json) loads as it is and serves as fp8.
    quantization = quant_fp8.prepare_checkpoint(hf_config, state, quantization, device)
    with torch.device("meta"):
        net = LlamaForCausalLM(hf_config)
    tied = net.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    if presharded:
        from plimsoll.runtime.models.tensor_parallel import shard_model

        shard_model(net, tensor_parallel)  # type: ignore[arg-type]
    fused = fuse_hf_state_dict(state)
    quant_fp8.install_modules(net, fused)
    missing, unexpected = net.load_state_dict(fused, strict=False, assign=True)
    if presharded and tied:  # the sharded head is the sharded embedding, assigned just now
        net.lm_head.weight = net.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"weights in {directory} do not match a {type(net).__name__} built from its config: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    # Non-persistent buffers (RoPE inv_freq) were created on meta; rebuild them for real.
    from plimsoll.runtime.models.llama import RotaryEmbedding

    net.model.rotary_emb = RotaryEmbedding(hf_config)
    if tensor_parallel is not None and tensor_parallel.world_size > 1 and not presharded:
        from plimsoll.runtime.models.tensor_parallel import shard_model

        shard_model(net, tensor_parallel)
    tied = bool(net.tie_word_embeddings)
    if quantization is not None:
        from plimsoll.runtime.models.quant import quantize_model

        # Before the cast, from the checkpoint's own values (a bf16 cast would hide a
        # dequantised checkpoint's grid); the int8 modules keep their scales float32.
        quantize_model(net, quantization, dtype)
    inv_freq = net.model.rotary_emb.inv_freq  # float32, as RotaryEmbedding computed it
    net = net.to(device=device, dtype=dtype).eval()
    # The cast took the RoPE frequencies to the model dtype too; casting back would not restore
    # the lost bits (~2^-9 of each frequency in bf16, a phase error growing with position).
    net.model.rotary_emb.inv_freq = inv_freq.to(device)
    if quantization is not None and tied:
        share_tied_int8_head(net)
    realign_weights(net)
    rank = f"{tensor_parallel.rank}/{tensor_parallel.world_size}" if tensor_parallel is not None else "0/1"
    net.checkpoint_fingerprint = checkpoint_fingerprint(directory, gguf_file, dtype, quantization, rank)
    loaded = _loaded(net, hf_config, tokenizer, directory, gguf_file)
    if weight_cache is not None:
        cache, key = weight_cache, net.checkpoint_fingerprint
        if defer_store:
            loaded.store_weights = lambda: cache.store(key, net)
        else:
            cache.store(key, net)
    return loaded


def _loaded(
    net: LlamaForCausalLM, hf_config: Any, tokenizer: Any, directory: Path, gguf_file: str | None
) -> LoadedModel:
    return LoadedModel(
        model=net,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(directory, gguf_file, hf_config, tokenizer),
        path=directory,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
    )
