"""``torch.compile`` of the model's forward: a few graphs for every step shape, cached on disk.

What it is: ``CompiledForward(model)``, called like the model's forward, runs
``LlamaForCausalLM.forward_opaque`` compiled by inductor with ``fullgraph=True``. Attention is
the opaque ``torch.ops.plimsoll.attention`` (``attention/attention_op.py``) and inductor fuses
what lies between two of them (RMSNorm with the residual add, RoPE, SiLU × up, FP8 activation
scaling) into a few generated kernels (Triton on CUDA, C++ on CPU) instead of ~30 small ones
a layer. The token dimension is dynamic, so one graph serves every step of two or more tokens
(decode batches, prefill, chunked prefill mixed with decodes, speculative verification) and one
more serves one-token steps (torch specialises a size of 1); each is compiled once, the first
time a step of its kind runs (at start: CUDA-graph capture or the engine's warm-up). The
decode CUDA graphs (``cuda_graphs.py``) are captured over this forward, so a replay runs the
fused kernels with the attention kernels between them.

``use_cache_dir(path)`` points inductor's caches (FX graphs, AOT autograd, its Triton kernels)
and Triton's own (the attention kernels) at ``path``: a restart with the same directory loads
what the last one compiled instead of compiling again. ``cache_counters()`` reads torch's hit
and miss counters, which is how a test tells a warm start from a cold one.

What it is not: a second model definition (``models/llama.py`` is traced as it is), or the
decision of which steps run compiled (``model_runner.py``: not LoRA steps with adapters, not
tensor parallelism).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plimsoll.runtime.attention.attention_op import PagedAttend, step_context
from plimsoll.runtime.attention.backends import AttentionMetadata, PagedAttention, StoreKV

log = logging.getLogger(__name__)


def use_cache_dir(path: str) -> Path:
    """Make ``path`` the home of every compile cache of this process (created if missing).

    Inductor reads its directory from ``TORCHINDUCTOR_CACHE_DIR`` each time it looks one up (it
    has no other setting), so this writes that variable; it reads no environment. Triton's own
    cache (the attention kernels, not inductor's) is the knob ``triton.knobs.cache.dir``, which
    reads ``TRITON_CACHE_DIR`` whenever it is not set in Python: a process that has not imported
    triton gets the variable, not the import (a third of a second of a CPU replica's start, for
    kernels it may never compile).
    """
    root = Path(path).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root)
    triton_dir = str(root / "triton-jit")
    triton = sys.modules.get("triton")
    if triton is None:
        os.environ["TRITON_CACHE_DIR"] = triton_dir
        return root
    try:
        triton.knobs.cache.dir = triton_dir
    except AttributeError:  # an older triton without knobs reads the variable
        os.environ["TRITON_CACHE_DIR"] = triton_dir
    return root


def cache_counters() -> dict[str, int]:
    """torch's compile-cache counters in this process: FX-graph and AOT-autograd hits and misses."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aot_autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


class CompiledForward:
    """The model's forward, compiled; ``compile_seconds`` and ``graphs`` say what start-up paid."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            model.forward_opaque, fullgraph=True, dynamic=None
        )
        self._kinds_seen: set[bool] = set()  # one-token steps (True) and longer ones (False)
        self.compile_seconds = 0.0
        self.graphs = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedAttend) -> torch.Tensor:
        n = input_ids.shape[0]
        one_token = n == 1
        if n >= 2:
            # One graph for every length >= 2 (0 and 1 are always specialised by torch).
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        first = one_token not in self._kinds_seen
        t = time.monotonic()
        with step_context(step):
            hidden: torch.Tensor = self._compiled(input_ids, positions)
        if first:
            self._kinds_seen.add(one_token)
            if input_ids.device.type == "cuda":
                torch.cuda.synchronize(input_ids.device)
            seconds = time.monotonic() - t
            self.compile_seconds += seconds
            self.graphs += 1
            log.info(
                "compiled the forward for %s steps in %.1f s (compile caches: %s)",
                "one-token" if one_token else "multi-token",
                seconds,
                cache_counters(),
            )
        return hidden

    def warm_up(
        self,
        device: torch.device,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        store_kv: StoreKV,
        paged_attention: PagedAttention,
    ) -> None:
        """Compile both graphs now: one- and two-token steps that store nothing (slot -1) and read
        one cached token of block 0."""
        for n in (2, 1):
            meta = AttentionMetadata(
                slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
                block_tables=torch.zeros((n, 1), dtype=torch.int32, device=device),
                cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
                context_lens=torch.ones(n, dtype=torch.int32, device=device),
                max_q_len=1,
            )
            ids = torch.zeros(n, dtype=torch.int64, device=device)
            self(ids, torch.zeros_like(ids), PagedAttend(kv_caches, meta, store_kv, paged_attention))
