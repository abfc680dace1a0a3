"""Sleep and wake, vLLM's sleep mode: give back an idle replica's memory without ending its process.

What it is: :func:`sleep` and :func:`wake_up` on an idle ``LLMEngine`` (run on its
engine thread), behind ``--enable-sleep-mode`` and the server's ``POST /sleep?level=``,
``POST /wake_up`` and ``GET /is_sleeping``:

* **level 1** frees the KV cache (its contents are forgotten, the prefix cache is
  emptied) and moves the weights off the accelerator into pinned host memory. On a CPU
  replica the weights and their packed panels stay as they are (they are what serving
  needs again, and host memory is where they would go); only the KV cache is freed, in
  place (``engine/kv_pages.py``: its pages go back to the kernel), so waking only takes
  the pages back, zeroed, and the next request is served at once.
* **level 2** frees the KV cache and drops the weights (and on CPU their packed panels);
  waking reads them again from the checkpoint (``load_model``: safetensors memory-mapped,
  page cache warm) into the same modules, so nothing that holds the model (LoRA slots, the
  runner) notices, and packs the panels again.

Elsewhere memory is freed by shrinking each tensor's storage to zero bytes rather than by
dropping the tensors: the KV cache tensors are referenced by the attention backend, the
KV tiers and the fused CPU step, and keep their identity across a sleep. On wake the
storages grow back (zeroed KV, weights copied back or swapped in) and a one-token request
runs through every stage, so the first real request pays no first-call costs (on CUDA the
decode graphs are recaptured first: their addresses moved). After freeing heap memory on
CPU, glibc is asked to return it (``malloc_trim``); on CUDA the caching allocator empties
its cache.

What it is not: a scheduler of sleeps (the operator's planner decides which replica
sleeps), or usable with requests in flight (the server refuses; drain first) or with
tensor parallelism (the config refuses).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plimsoll.runtime.engine import kv_pages

if TYPE_CHECKING:
    from plimsoll.runtime.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


class SleepModeError(ValueError):
    """A sleep or wake that cannot happen as asked (not enabled, busy, a bad level)."""


@dataclass
class SleepState:
    """What a sleeping engine set aside: storage sizes to grow back, host copies of offloaded weights."""

    level: int = 0  # 0 = awake
    kv_bytes: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    host_copies: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)
    freed_bytes: int = 0
    slept_at: float = 0.0
    # The KV tensors' pages were released where they are (CPU, engine/kv_pages.py), not resized.
    kv_released: bool = False
    # Nothing that serving reads moved or was dropped (a CPU level 1: the KV pages were released in
    # place, weights and panels kept): waking needs neither a warm-up request nor new addresses.
    in_place: bool = False


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (for copies that ignore dtype and shape)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _model_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """Each distinct storage behind the model's parameters and buffers (tied weights count once)."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(storage)
    return out


def _runners(engine: LLMEngine) -> list[Any]:
    draft = getattr(getattr(engine, "speculator", None), "draft", None)
    return [engine.runner] + ([draft.runner] if draft is not None and hasattr(draft, "runner") else [])


def _release_host_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    # Freed blocks below glibc's mmap threshold stay on the heap (kernels/host_memory.py raises
    # the trim threshold on purpose); a sleep is the moment to hand them back.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _fused_steps(engine: LLMEngine) -> list[Any]:
    """Each runner's fused CPU step that holds packed panels (none on an accelerator)."""
    out = []
    for runner in _runners(engine):
        fused = getattr(getattr(runner, "cpu_plan", None), "fused", None)
        if fused is not None and fused.panels:
            out.append(fused)
    return out


def sleep(engine: LLMEngine, level: int) -> SleepState:
    """Put an idle engine to sleep at ``level`` (1 or 2); returns what was set aside."""
    if level not in SLEEP_LEVELS:
        raise SleepModeError(f"level must be 1 or 2, got {level}")
    if not engine.config.enable_sleep_mode:
        raise SleepModeError("sleep mode is off; start the server with --enable-sleep-mode")
    if engine.has_unfinished_requests():
        raise SleepModeError("requests are in flight; drain them before sleeping")
    state: SleepState = engine.sleep_state
    if state.level >= level:
        return state  # already this deep (vLLM answers a repeated sleep the same way)
    if state.level:
        wake_up(engine)  # from level 1 to 2: the weights come back to the device first, then go
        state = engine.sleep_state
    started = time.monotonic()
    engine.scheduler.kv.reset_prefix_cache()
    device = engine.device
    # On CPU the KV tensors sit on pages of their own (kv_pages.allocate): released where they are.
    in_place = device.type == "cpu" and kv_pages.supported()
    freed = 0
    for runner in _runners(engine):
        for k, v in runner.kv_caches:
            for t in (k, v):
                if in_place:
                    freed += kv_pages.release(t)
                    continue
                storage = t.untyped_storage()
                state.kv_bytes.append((storage, storage.nbytes()))
                freed += storage.nbytes()
                storage.resize_(0)
    if level == 2:
        for fused in _fused_steps(engine):
            if fused.mapped:  # pages of the panel cache's file: dropped, read again from it when used
                freed += sum(kv_pages.release(p.data) for layer in fused.panels for p in layer)
                freed += kv_pages.release(fused.head.data) if fused.head is not None else 0
            else:
                freed += fused.drop_panels()  # copies of the weights dropped below; packed again on wake
    for runner in _runners(engine):
        for storage in _model_storages(runner.model):
            nbytes = storage.nbytes()
            if level == 1:
                if device.type == "cpu":
                    continue  # already in host memory, and what serving reads: kept as it is
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                host.copy_(_byte_view(storage))
                state.host_copies.append((storage, host))
            if not storage.resizable():  # pages of the weight cache's file: dropped; waking maps it again
                freed += kv_pages.release(_byte_view(storage))
                continue
            storage.resize_(0)
            freed += nbytes
    state.kv_released, state.in_place = in_place, in_place and level == 1
    if not state.in_place:
        # Heap blocks were freed (a level 1 in place freed none: trimming would only hand back the
        # activations' kept pages, which the next step would fault in again).
        _release_host_memory(device)
    state.level, state.freed_bytes, state.slept_at = level, freed, time.monotonic()
    log.info("asleep at level %d: %.1f MiB freed in %.3f s", level, freed / 2**20, time.monotonic() - started)
    return state


def wake_up(engine: LLMEngine) -> float:
    """Bring a sleeping engine back; returns the seconds it took (0 when it was awake)."""
    state: SleepState = engine.sleep_state
    if not state.level:
        return 0.0
    started = time.monotonic()
    for storage, nbytes in state.kv_bytes:
        storage.resize_(nbytes)
        _byte_view(storage).zero_()
    if state.kv_released:  # back zeroed at the same addresses, resident before a request needs them
        for runner in _runners(engine):
            for k, v in runner.kv_caches:
                kv_pages.populate(k)
                kv_pages.populate(v)
    if state.level == 2:
        _reload_weights(engine)
        for fused in _fused_steps(engine):
            if not fused.mapped:
                fused.repack()
    else:
        for storage, host in state.host_copies:
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=True)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    engine.sleep_state = SleepState()
    if state.in_place:
        # The KV pages come back zeroed at the same addresses; weights, panels and every address
        # are as they were, so the first request is served as before the sleep, with no warm-up.
        took = time.monotonic() - started
        log.info("awake after %.3f s (level 1, in place)", took)
        return took
    for runner in _runners(engine):
        if getattr(runner, "decode_graphs", None) is not None and engine.device.type == "cuda":
            engine.recapture_cuda_graphs()  # the graphs hold the old addresses of the weights and KV
            break
    engine.warmup_first_request()
    took = time.monotonic() - started
    log.info("awake after %.3f s", took)
    return took


def _reload_weights(engine: LLMEngine) -> None:
    """Level 2: read the checkpoint again and put its tensors back into the same modules."""
    from plimsoll.runtime.models.loader import load_model

    config = engine.config
    if (
        getattr(engine, "speculator", None) is not None
        and getattr(engine.speculator, "draft", None) is not None
    ):
        raise SleepModeError("level 2 sleep with a draft model is not supported; use level 1")
    from plimsoll.runtime.engine.model_runner import weight_cache

    # Weights mapped from the weight cache are mapped again: nothing is read until a step reads it.
    cache = weight_cache(config)
    fresh = load_model(
        config.model, config.torch_dtype, engine.device, config.quantization, weight_cache=cache
    ).model
    model = engine.runner.model
    fresh_params = dict(fresh.named_parameters())
    for name, param in model.named_parameters():
        param.data = fresh_params[name].data
    fresh_buffers = dict(fresh.named_buffers())
    for module_name, module in model.named_modules():
        for name in list(module._buffers):
            full = f"{module_name}.{name}" if module_name else name
            if full in fresh_buffers and module._buffers[name] is not None:
                module._buffers[name] = fresh_buffers[full]
    del fresh, fresh_params, fresh_buffers
    gc.collect()


__all__ = ["SLEEP_LEVELS", "SleepModeError", "SleepState", "sleep", "wake_up"]
