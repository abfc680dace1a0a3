"""The tokenizer and config read without transformers equal transformers' (models/tokenizer.py,
models/chat_template.py, models/model_config.py), and the serving path never imports transformers."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from plimsoll.runtime.models.chat_template import render
from plimsoll.runtime.models.loader import load_model, read_hf_config
from plimsoll.runtime.models.model_config import read_llama_config
from plimsoll.runtime.models.tokenizer import FastTokenizer, load_tokenizer
from plimsoll.runtime.testing import write_tiny_model

TEXTS = [
    "The capital of France is",
    " leading space and trailing ",
    "héllo wörld 🚀\n\n\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
    "<s>x</s>",
    "日本語のテキスト",
    "",
]
CHATS = [
    [{"role": "user", "content": "hi <b>&amp;"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red.", "name": None},
        {"role": "user", "content": "Another?"},
    ],
]
# What the runtime reads of a model's config (models/llama.py, loader, KV sizing, LoRA, TP, quant).
CONFIG_ATTRIBUTES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "hidden_act", "rope_parameters", "architectures", "model_type",
    "eos_token_id", "bos_token_id", "sliding_window", "use_sliding_window", "quantization_config",
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from plimsoll.runtime.models.embedded import ensure_embedded_model

    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")  # byte-level, a chat template
    return {"smollm2": ensure_embedded_model("smollm2-135m"), "tiny": tiny}


@pytest.mark.parametrize("name", ["smollm2", "tiny"])
def test_fast_tokenizer_equals_transformers(model_dirs: dict[str, Path], name: str) -> None:
    from transformers import AutoTokenizer

    directory = model_dirs[name]
    fast, ref = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    assert isinstance(fast, FastTokenizer)
    assert (len(fast), fast.eos_token_id, fast.bos_token_id) == (len(ref), ref.eos_token_id, ref.bos_token_id)
    assert fast.special_tokens_map == ref.special_tokens_map
    assert fast.chat_template == ref.chat_template is not None
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special
            )
        assert fast(text).input_ids == list(ref(text).input_ids)
        ids = ref.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for token_id in range(
        0, len(ref), max(1, len(ref) // 400)
    ):  # lone tokens, as the detokenizer decodes them
        assert fast.decode([token_id]) == ref.decode([token_id])
    for chat in CHATS:
        for generation_prompt in (True, False):
            text = fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
            assert text == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt
            )
            ids = fast.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)
            assert ids == ref.apply_chat_template(
                chat, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
            )
    # A continued final message and template kwargs, as a client may send them.
    assert fast.apply_chat_template(
        CHATS[1], tokenize=False, continue_final_message=True
    ) == ref.apply_chat_template(CHATS[1], tokenize=False, continue_final_message=True)


def test_client_template_renders_as_transformers_does() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ bos_token }}{{ m.role }}: {{ m.content | tojson }}{% if m.thinking %} [{{ m.thinking }}]{% endif %}\n"
        "{% endfor %}{% generation %}{{ ns.n }} {{ flavour }}{% endgeneration %}"
        "{% if add_generation_prompt %}assistant:{% endif %}{{ strftime_now('%Y') | length }}"
    )
    messages = [
        {"role": "user", "content": "<b>x</b> é"},
        {"role": "assistant", "content": "y", "reasoning": "r"},
    ]
    context: dict[str, Any] = {"bos_token": "<s>", "flavour": "mint"}
    ours = render(template, messages, True, {"bos_token": "<s>"}, flavour="mint")
    (theirs,), _ = render_jinja_template(  # type: ignore[misc]
        conversations=[messages], chat_template=template, add_generation_prompt=True, **context
    )
    assert ours == theirs
    with pytest.raises(Exception, match="underscore"):
        render("{% set ns = namespace(_x=1) %}", messages, False)
    with pytest.raises(Exception, match="stop"):
        render("{{ raise_exception('stop') }}", messages, False)


@pytest.mark.parametrize("name", ["smollm2", "tiny"])
def test_config_read_directly_equals_autoconfig(model_dirs: dict[str, Path], name: str) -> None:
    from transformers import AutoConfig

    fast, ref = read_llama_config(model_dirs[name]), AutoConfig.from_pretrained(str(model_dirs[name]))
    assert fast is not None
    for attribute in CONFIG_ATTRIBUTES:
        assert getattr(fast, attribute, None) == getattr(ref, attribute, None), attribute


def test_other_files_fall_back_to_transformers(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    # A tokenizer_config that makes transformers rewrite the file's post-processor; RoPE scaling in the config.
    directory = tmp_path / "model"
    shutil.copytree(model_dirs["tiny"], directory)
    tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tok_config, "add_bos_token": True}))
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    (directory / "config.json").write_text(json.dumps(config))
    assert load_tokenizer(directory) is None and read_llama_config(directory) is None
    loaded = load_model(str(directory), dtype=torch.float32)
    assert type(loaded.tokenizer).__module__.startswith("transformers")
    assert read_hf_config(str(directory)).rope_parameters["rope_type"] == "linear"
    assert read_llama_config(model_dirs["tiny"]) is not None


def test_serving_a_plain_model_never_imports_transformers(model_dirs: dict[str, Path]) -> None:
    """The server, the engine, a completion and a chat on the tiny model, in a fresh interpreter."""
    probe = f"""
import sys
from plimsoll.runtime.serving import server  # noqa: F401  (the HTTP app's modules)
from plimsoll.runtime import LLM, SamplingParams
llm = LLM(model={str(model_dirs["tiny"])!r}, kv_cache_memory=1 << 20, max_model_len=64)
out = llm.generate(["ab"], SamplingParams(max_tokens=2, temperature=0))
llm.tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=True)
loaded = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
print("TRANSFORMERS", loaded[:5])
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=False
    )
    assert "TRANSFORMERS []" in result.stdout, result.stdout + result.stderr[-3000:]
