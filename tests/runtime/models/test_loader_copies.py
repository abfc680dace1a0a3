"""Loading a checkpoint materialises its weights once (models/loader.py).

safetensors' ``load_file`` memory-maps the file; every tensor the loader then makes (the
fused q/k/v and gate/up projections, the realigned copies of weights the file placed mid
cache line) is counted here, op by op, with a dispatch mode: together they must come to
one copy of the weights, not two.
"""

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plimsoll.runtime.models.loader import load_model


class NewBytes(TorchDispatchMode):
    """Bytes of CPU storage that aten ops allocate (outputs that alias no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.device.type == "cpu"
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:
                    self.bytes += storage.nbytes()
        return out


def test_loading_makes_one_copy_of_the_weights_at_most(tiny_model_dir: Any) -> None:
    directory = tiny_model_dir("llama")
    with NewBytes() as counted:
        net = load_model(str(directory), torch.float32).model
    weights = sum(t.untyped_storage().nbytes() for t in {id(p): p for p in net.parameters()}.values())
    assert weights > 0
    # The rotary tables and other small buffers are the only extra; a second copy would be 2x.
    assert counted.bytes <= 1.05 * weights, (counted.bytes, weights)
