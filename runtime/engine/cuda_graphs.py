"""CUDA graphs of uniform steps' forward, one per batch size (vLLM's cudagraph capture sizes).

What it is: at start, the forward (the model's, or its ``torch.compile``:
``engine/compilation.py``) of steps where every sequence brings ``query_len`` new tokens is
captured once per size in ``capture_sizes(max_num_seqs)`` into graphs that share one memory
pool, over static input buffers sized for the largest batch and the longest context
(``max_model_len``). ``query_len`` 1 is a decode step; ``1 + k`` a speculative verify step
where every sequence carries k proposals (the attention's longest query is then known when
capturing, so the prefill kernel's grid is fixed too). A step of ``n`` sequences copies its
inputs into the first rows of the buffers, pads the rest (slot ``-1``: nothing stored;
context length ``0``: nothing read), replays the graph of the smallest size ``>= n`` and
reads its first ``n * query_len`` rows. One replay launches every kernel of every layer
without Python or launch gaps between them, which is most of a small decode step's time on
a GPU. The logits are computed outside the graph, on the rows that sample. LoRA servers use
the graphs for steps where no row runs an adapter (captured with no adapter active).

What it is not: prefill or mixed steps (their shapes vary: they run the compiled forward
without a graph), steps with adapter rows, tensor parallelism, or the torch attention
backend (its decode path syncs with the host). ``enforce_eager`` (vLLM's ``--enforce-eager``)
turns it off.

``DecodeGraphs(..., capture=False)`` keeps the static buffers and the padding but runs
the forward eagerly on them: the tests use it on a CPU (Triton's interpreter), where no
graph can be captured, to check everything but the capture itself against the plain path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from plimsoll.runtime.attention.backends import AttentionMetadata

log = logging.getLogger("plimsoll.runtime")

# vLLM captures 1, 2, 4 and then every multiple of 8 up to its limit (512 by default).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, then multiples of 8, up to ``max_num_seqs``
    (which is always one of them, so every decode batch has a graph)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def ineligible_reason(
    device: torch.device,
    attention_backend: str,
    enforce_eager: bool,
    tensor_parallel: bool = False,
) -> str | None:
    """Why uniform steps on this engine cannot replay CUDA graphs (None: they can)."""
    if enforce_eager:
        return "enforce_eager is set"
    if device.type != "cuda":
        return f"the engine runs on {device.type}, not CUDA"
    if attention_backend != "triton":
        return f"attention_backend={attention_backend!r} syncs with the host in decode (use 'triton')"
    if tensor_parallel:
        return "tensor parallelism runs its ranks eagerly"
    return None


class DecodeGraphs:
    def __init__(
        self,
        # One step's forward over its attention metadata (the caller binds the KV caches and the
        # attention backend): (input_ids [N], positions [N], meta) -> hidden states [N, hidden].
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
        query_len: int = 1,
        sizes: list[int] | None = None,
    ) -> None:
        self.forward = forward
        self.block_size = block_size
        self.device = device
        self.query_len = q = query_len
        self.sizes = capture_sizes(max_num_seqs) if sizes is None else [s for s in sizes if s <= max_num_seqs]
        if not self.sizes:
            raise ValueError(f"no CUDA graph capture size is at most max_num_seqs={max_num_seqs}: {sizes}")
        self.max_blocks = -(-max_model_len // block_size) + 1  # one spare block per sequence
        top = self.sizes[-1]
        # Inference tensors, like every step's own inputs: the compiled forward guards on the kind,
        # and one kind means one graph for both.
        with torch.inference_mode():
            self.input_ids = torch.zeros(top * q, dtype=torch.int64, device=device)
            self.positions = torch.zeros(top * q, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((top * q,), -1, dtype=torch.int64, device=device)
            self.block_tables = torch.zeros((top, self.max_blocks), dtype=torch.int32, device=device)
            self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=device) * q
            self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        # Host staging rows (pinned on CUDA, so the copies to the device do not wait for a sync).
        pin = device.type == "cuda"
        self._host_tokens = torch.zeros((3, top * q), dtype=torch.int64, pin_memory=pin)  # ids, pos, slots
        self._host_ctx = torch.zeros(top, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((top, self.max_blocks), dtype=torch.int32, pin_memory=pin)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0
        self.replays = 0
        self._copied: torch.cuda.Event | None = None

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: size * self.query_len],
            block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            context_lens=self.context_lens[:size],
            max_q_len=self.query_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        n = size * self.query_len
        return self.forward(self.input_ids[:n], self.positions[:n], self._meta(size))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per size, largest first (the smaller ones reuse its pool memory).
        The buffers hold padding meanwhile: the warm-up runs store nothing and read nothing."""
        if not self.capture:
            return
        t = time.monotonic()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles the Triton kernels (and the forward) for this shape
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.monotonic() - t
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "captured CUDA graphs of %s steps for batch sizes %s in %.1f s (%.0f MiB)",
            "decode" if self.query_len == 1 else f"{self.query_len}-token verify",
            ",".join(map(str, self.sizes)),
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def size_for(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def eligible(self, scheduled: list[tuple[Any, int]]) -> bool:
        """Every sequence brings ``query_len`` tokens: its last one (decode) and, for a verify step,
        exactly ``query_len - 1`` proposals; and the step fits the buffers."""
        q = self.query_len
        return (
            0 < len(scheduled) <= self.sizes[-1]
            and all(num_new == q and len(req.spec_token_ids) == q - 1 for req, num_new in scheduled)
            and max(len(req.block_ids) for req, _ in scheduled) <= self.max_blocks
        )

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Any, int]]) -> tuple[torch.Tensor, list[int]]:
        """Replay the step; return the hidden states ``[n * query_len, hidden]`` (a view of the
        graph's output, valid until the next replay) and the row of each sequence's last token
        (``-1`` for one whose prompt is still being prefilled, a token at a time; a verify step's
        sequences sample their ``query_len`` rows ending there)."""
        n, q = len(scheduled), self.query_len
        size = self.size_for(n)
        assert size is not None, "eligible() first"
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the staging rows
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        ctx, last_rows, tables = [], [], []
        for i, (req, _) in enumerate(scheduled):
            end = req.num_computed_tokens  # the scheduler has already booked this step
            blocks = req.block_ids
            spec = req.spec_token_ids
            tokens = req.all_token_ids + spec if spec else req.all_token_ids
            for p in range(end - q, end):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            ctx.append(end)
            tables.append(blocks)
            last_rows.append((i + 1) * q - 1 if end == req.num_tokens + len(spec) else -1)
        width = max(map(len, tables))
        pad = (size - n) * q  # padding rows: token 0 at position 0, stored nowhere, attending to nothing
        host = self._host_tokens
        rows = size * q
        host[:, :rows] = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad])
        self._host_ctx[:size] = torch.tensor(ctx + [0] * (size - n), dtype=torch.int32)
        self._host_tables[:n, :width] = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
        )
        pinned = host.is_pinned()
        self.input_ids[:rows].copy_(host[0, :rows], non_blocking=pinned)
        self.positions[:rows].copy_(host[1, :rows], non_blocking=pinned)
        self.slot_mapping[:rows].copy_(host[2, :rows], non_blocking=pinned)
        self.context_lens[:size].copy_(self._host_ctx[:size], non_blocking=pinned)
        # Only the columns this step's tables use: the kernels read no block past a context's end.
        self.block_tables[:n, :width].copy_(self._host_tables[:n, :width], non_blocking=pinned)
        if pinned:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call,unused-ignore]  # torch.cuda.Event.__init__ is unannotated (torch 2.15)
            self._copied.record()
        self.replays += 1
        if self.capture:
            self.graphs[size].replay()
            out = self.outputs[size]
        else:
            out = self._forward(size)
        return out[: n * q], last_rows
