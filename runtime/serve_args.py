"""Checks `plimsoll serve` runs on its flags before it loads anything or binds a port.

What it is: the vLLM spellings `plimsoll serve` accepts (a positional model,
``--dtype auto|bf16|half``, ``--kv-cache-memory-bytes``, ``--gpu-memory-utilization``)
turned into plimsoll's settings, plus the mistakes a newcomer makes first (a model
path that does not exist, a port in use), each raised as :class:`ServeArgError`
with a message of one line saying what is wrong and how to fix it.
What it is not: the engine's own validation (``EngineConfig``) or the model loader.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

# vLLM's --dtype spellings; "auto" keeps full precision on CPU (no fast bf16 matmul
# there) and takes bfloat16 on an accelerator, as vLLM does for float32 checkpoints.
DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "half": "float16",
    "float16": "float16",
    "fp16": "float16",
    "float": "float32",
    "float32": "float32",
    "fp32": "float32",
}
# Hub ids whose weights ship inside plimsoll (nothing is downloaded).
EMBEDDED_HUB_IDS = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m"}


class ServeArgError(ValueError):
    """A `plimsoll serve` flag that cannot work; the message says how to fix it."""


def choose_model(positional: str | None, option: str | None) -> str:
    """The model to serve: ``plimsoll serve MODEL`` (vLLM) or ``--model MODEL``."""
    if positional and option and positional != option:
        raise ServeArgError(f"two models given ({positional!r} and --model {option!r}); pass one of them")
    model = positional or option or "smollm2-135m"
    return EMBEDDED_HUB_IDS.get(model, model)


def resolve_dtype(dtype: str, device: str) -> str:
    """vLLM's ``--dtype`` values to plimsoll's three; ``auto`` by device."""
    value = dtype.lower()
    if value == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if value not in DTYPE_ALIASES:
        raise ServeArgError(
            f"--dtype {dtype!r} is not a dtype; use auto, bfloat16 (bf16), float16 (half) or float32"
        )
    return DTYPE_ALIASES[value]


def resolve_device(device: str) -> str:
    """``--device auto``: ``cuda`` where torch sees a CUDA GPU, else ``cpu`` (vLLM picks its
    platform from what it finds, too); any other value is kept."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_attention_backend(backend: str, device: str) -> str:
    """``--attention-backend auto``: ``triton`` on CUDA where the triton package imports (its
    paged kernels, and decode steps replaying CUDA graphs), else ``torch``."""
    if backend != "auto":
        return backend
    if device.startswith("cuda"):
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return "torch"


def check_model(model: str) -> None:
    """Fail on a model that cannot load, before the engine or the port is touched."""
    from plimsoll.runtime.models.embedded import EMBEDDED_MODELS

    if model in EMBEDDED_MODELS:
        return
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ServeArgError(
                f"model {model} is a file but not a .gguf; pass a .gguf file or a model directory"
            )
        return
    if path.is_dir():
        has_gguf = any(path.glob("*.gguf"))
        if not (path / "config.json").exists() and not has_gguf:
            raise ServeArgError(
                f"model directory {model} has no config.json (nor a .gguf); pass a Hugging Face "
                "model directory (config.json, tokenizer, *.safetensors) or a .gguf file"
            )
        if (path / "config.json").exists() and not any(path.glob("*.safetensors")):
            raise ServeArgError(
                f"model directory {model} has config.json but no *.safetensors weights; "
                "save the model with save_pretrained(..., safe_serialization=True)"
            )
        return
    if "/" in model and not model.startswith(("/", ".", "~")):
        raise ServeArgError(
            f"model {model!r} looks like a hub id, and `plimsoll serve` downloads nothing; fetch it with "
            f"`plimsoll fetch hf://{model} --local-dir DIR` and run `plimsoll serve DIR`"
        )
    raise ServeArgError(
        f"model {model} does not exist; pass a model directory, a .gguf file, or smollm2-135m (embedded)"
    )


def check_port(host: str, port: int) -> None:
    """Fail on a port another process holds, before minutes of model loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # uvicorn sets SO_REUSEADDR too: only a live listener makes this fail.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ServeArgError(
                    f"port {port} on {host} is in use by another process; stop it or pass --port N"
                ) from exc
            raise ServeArgError(
                f"cannot bind {host}:{port} ({exc.strerror}); check --host and --port"
            ) from exc


def kv_cache_bytes(kv_cache_memory: str | None, kv_cache_memory_bytes: int | None) -> str | int:
    """``--kv-cache-memory-bytes`` (vLLM) or ``--kv-cache-memory`` (a size like 2GiB); default 1GiB."""
    if kv_cache_memory is not None and kv_cache_memory_bytes is not None:
        raise ServeArgError("pass --kv-cache-memory or --kv-cache-memory-bytes, not both")
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    return kv_cache_memory if kv_cache_memory is not None else "1GiB"


def gpu_kv_cache_bytes(utilization: float, device: str, model: str) -> int:
    """vLLM's ``--gpu-memory-utilization``: this server may hold ``utilization`` × the device's
    memory; the KV cache gets that less what is already in use there and the model's weights
    (their file size: an estimate, exact for unquantised safetensors at the served dtype)."""
    if not 0 < utilization <= 1:
        raise ServeArgError(f"--gpu-memory-utilization {utilization} must be in (0, 1], e.g. 0.9")
    if not device.startswith("cuda"):
        raise ServeArgError(
            "--gpu-memory-utilization needs --device cuda; on CPU size the cache with "
            "--kv-cache-memory-bytes (or --kv-cache-memory 2GiB)"
        )
    import torch

    if not torch.cuda.is_available():
        raise ServeArgError("--gpu-memory-utilization: no CUDA device is visible; check CUDA_VISIBLE_DEVICES")
    free, total = torch.cuda.mem_get_info(torch.device(device))
    path = Path(model).expanduser()
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), *path.glob("*.gguf")]
    weights = sum(f.stat().st_size for f in files if f.exists())
    budget = int(utilization * total) - (total - free) - weights
    if budget <= 0:
        raise ServeArgError(
            f"--gpu-memory-utilization {utilization}: {utilization:.0%} of {total / 2**30:.1f} GiB leaves no "
            f"room for the KV cache beside {(total - free) / 2**30:.1f} GiB in use and "
            f"{weights / 2**30:.1f} GiB of weights; raise it or free the device"
        )
    return budget


def environment_malloc_settings() -> str | None:
    """Why this process's malloc is configured by its environment (``MALLOC_*`` or glibc's malloc
    tunables), so the engine should leave its thresholds alone (``keep_freed_memory``), or ``None``."""
    names = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return f"malloc is configured by the environment ({', '.join(names)})" if names else None


def parse_lora_module(text: str) -> dict[str, str]:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ServeArgError(f"--lora-modules {text!r} is not valid JSON ({exc})") from None
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise ServeArgError(f'--lora-modules {text!r}: the JSON form needs "name" and "path"')
        extra = set(value) - {"name", "path", "base_model_name"}
        if extra:
            raise ServeArgError(f"--lora-modules {text!r}: unknown keys {sorted(extra)}; use name, path")
        return {k: str(v) for k, v in value.items()}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ServeArgError(
            f"--lora-modules {text!r} is not name=path; pass e.g. --lora-modules sql=/adapters/sql"
        )
    return {"name": name, "path": path}


def served_name(names: list[str] | None) -> str | None:
    """``--served-model-name``: vLLM takes several (aliases); plimsoll serves one name."""
    if names and len(names) > 1:
        raise ServeArgError(
            f"--served-model-name {' '.join(names)}: plimsoll serves a model under one name; pass one "
            "(clients send it as `model`)"
        )
    return names[0] if names else None


def max_new_tokens(flag: int | None, override_generation_config: str | None) -> int | None:
    """The server's max_tokens default and limit: ``--max-new-tokens N`` or vLLM's
    ``--override-generation-config '{"max_new_tokens": N}'`` (its only key plimsoll reads)."""
    from_json: int | None = None
    if override_generation_config is not None:
        try:
            value = json.loads(override_generation_config)
        except ValueError as exc:
            raise ServeArgError(f"--override-generation-config is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ServeArgError(
                "--override-generation-config takes a JSON object, e.g. '{\"max_new_tokens\": 512}'"
            )
        extra = sorted(set(value) - {"max_new_tokens"})
        if extra:
            raise ServeArgError(
                f"--override-generation-config: plimsoll reads only max_new_tokens, not {', '.join(extra)}; "
                "send sampling values with each request"
            )
        from_json = value.get("max_new_tokens")
        if from_json is not None and (
            not isinstance(from_json, int) or isinstance(from_json, bool) or from_json < 1
        ):
            raise ServeArgError(
                f"--override-generation-config max_new_tokens {from_json!r} must be an integer >= 1"
            )
    if flag is not None and from_json is not None and flag != from_json:
        raise ServeArgError(
            f"--max-new-tokens {flag} and --override-generation-config max_new_tokens {from_json} disagree; pass one"
        )
    return flag if flag is not None else from_json


def _is_lora_module(arg: str) -> bool:
    return "=" in arg or arg.lstrip().startswith("{")


def _is_value(arg: str) -> bool:
    return not arg.startswith("-")


# vLLM's flags that take several values after one flag (argparse ``nargs="+"``), each with what
# counts as one of its values: the positional MODEL after ``--lora-modules a=p`` is not a module.
MULTI_VALUE_FLAGS = {
    "--lora-modules": _is_lora_module,
    "--served-model-name": _is_value,
}


def expand_multi_value_flags(argv: list[str]) -> list[str]:
    """vLLM's ``--lora-modules a=p b=q`` (several values after one flag) as click's repeated form.

    For each flag in :data:`MULTI_VALUE_FLAGS`, the values after it, up to the next option or
    the first word that is not one of its values, become ``--flag a=p --flag b=q``, wherever
    the flag stands (start, middle or end of the line); anything else (the positional MODEL)
    is left alone. A flag with no value at all stays as it is, so click says it needs one.
    ``--flag=value`` is click's own form and passes through.
    """
    out: list[str] = []
    flag: str | None = None  # the multi-value flag whose values are being read
    taken = 0  # values read after it
    for arg in argv:
        if arg in MULTI_VALUE_FLAGS:
            if flag is not None and taken == 0:
                out.append(flag)
            flag, taken = arg, 0
            continue
        if flag is not None and MULTI_VALUE_FLAGS[flag](arg):
            out += [flag, arg]
            taken += 1
            continue
        if flag is not None and taken == 0:
            out.append(flag)  # no value: click reports it (or takes this word, as it would)
        flag = None
        out.append(arg)
    if flag is not None and taken == 0:
        out.append(flag)
    return out
