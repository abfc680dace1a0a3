"""What the loader's cast must leave alone: RoPE frequencies stay float32 after a bf16 load
(recomputed, not cast back), and a tied int8 head keeps sharing the embedding's matrix after
the move to the device."""

from typing import Any

import pytest
import torch

from plimsoll.runtime.models.llama import RotaryEmbedding
from plimsoll.runtime.models.loader import load_model, share_tied_int8_head
from plimsoll.runtime.models.quant import weight_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama3-scaled RoPE and the default one
def test_inv_freq_after_a_bf16_load_equals_its_float32_recomputation(tiny_model_dir: Any, arch: str) -> None:
    loaded = load_model(str(tiny_model_dir(arch)), torch.bfloat16)
    inv_freq = loaded.model.model.rotary_emb.inv_freq
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16  # the cast did happen
    expected = RotaryEmbedding(loaded.hf_config).inv_freq
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, expected)
    assert not torch.equal(expected.to(torch.bfloat16).float(), expected)  # what a cast back would give


def test_a_tied_int8_head_shares_the_embeddings_storage_after_a_device_copy(tiny_model_dir: Any) -> None:
    loaded = load_model(str(tiny_model_dir("qwen2")), torch.float32, quantization="int8")  # tied embeddings
    net = loaded.model
    head, embed = net.lm_head, net.model.embed_tokens
    assert head.qweight.data_ptr() == embed.qweight.data_ptr()
    shared = weight_bytes(net)
    # What Module.to(cuda) does to buffers: each module gets its own copy.
    net._apply(lambda t: t.clone())
    assert head.qweight.data_ptr() != embed.qweight.data_ptr()
    assert weight_bytes(net) > shared
    share_tied_int8_head(net)
    assert all(getattr(head, n) is getattr(embed, n) for n in ("qweight", "scales", "offsets"))
    assert weight_bytes(net) == shared
