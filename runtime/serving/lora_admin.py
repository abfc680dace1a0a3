"""Run-time LoRA loading and unloading: vLLM's opt-in, allowed directories, and a cap.

What it is: :class:`LoRAAdmin`, behind ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (which ``auth.py`` already restricts to the admin key).
Loading at run time is off unless the server was started with
``--allow-runtime-lora-updating`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
a path is accepted only when, with symlinks followed, it lies under one of
``--lora-allowed-roots``; at most ``--max-registered-loras`` adapters are registered
at once. A path outside the roots gets one fixed message whether or not it exists,
so the endpoint cannot be used to map the replica's filesystem; the detail goes to
the log.

What it is not: the adapter reader (``models/lora.py``) or the registry
(``engine/lora_manager.py``); adapters given with ``--lora-modules`` at start are the
operator's choice and are not checked against the roots.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from plimsoll.runtime.engine.client import EngineClient
from plimsoll.runtime.serving.errors import APIError
from plimsoll.runtime.serving.settings import ServerSettings

log = logging.getLogger("plimsoll.runtime.serving.lora_admin")

OUTSIDE_ROOTS = (
    "lora_path is not a directory under the server's allowed roots (--lora-allowed-roots); load adapters "
    "from there"
)


def under_roots(path: str, roots: tuple[str, ...]) -> Path | None:
    """``path`` with symlinks resolved when it lies under one of ``roots`` (also resolved), else None."""
    if not roots or not os.path.isabs(path):
        return None
    real = Path(os.path.realpath(path))
    for root in roots:
        if real.is_relative_to(os.path.realpath(root)):
            return real
    return None


class LoRAAdmin:
    """The checks in front of the engine's ``add_lora`` / ``remove_lora``."""

    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._loading = asyncio.Lock()  # the cap is checked and filled by one load at a time

    def _check_enabled(self) -> None:
        if not self.engine.config.enable_lora:
            raise APIError(
                404,
                "LoRA adapters are not enabled on this server; start it with --enable-lora to load and unload "
                "adapters at run time.",
            )
        if not self.settings.allow_runtime_lora_updating:
            raise APIError(
                404,
                "Run-time LoRA updating is off on this server; start it with --allow-runtime-lora-updating "
                "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and --lora-allowed-roots DIR.",
            )
        if not self.engine.is_ready:
            raise APIError(503, "The model is still loading; retry when /ready answers 200.",
                           headers={"Retry-After": str(self.settings.retry_after_s)})  # fmt: skip

    async def load(self, name: str, path: str) -> None:
        from plimsoll.runtime.models.lora import LoRAAdapterError

        self._check_enabled()
        real = under_roots(path, self.settings.lora_allowed_roots)
        if real is None:
            log.warning("refused to load adapter %r from %r: not under %s",
                        name, path, list(self.settings.lora_allowed_roots) or "no allowed root")  # fmt: skip
            raise APIError(
                400, f"The lora adapter '{name}' was not loaded: {OUTSIDE_ROOTS}.", param="lora_path"
            )
        if not real.is_dir():
            # Inside the roots the server was given, saying what is wrong maps nothing new.
            raise APIError(
                400,
                f"The lora adapter '{name}' was not loaded: LoRA path {path!r} is not a directory; pass a PEFT "
                "adapter directory",
                param="lora_path",
            )
        async with self._loading:
            names = {lora.lora_name for lora in self.engine.list_loras()}
            registered, cap = len(names), self.settings.max_registered_loras
            if registered >= cap and name not in names:  # a taken name is the engine's "already loaded"
                raise APIError(
                    400,
                    f"The lora adapter '{name}' was not loaded: {registered} adapters are registered, the most "
                    f"this server takes (--max-registered-loras {cap}); unload one first.",
                    param="lora_name",
                )
            try:
                await self.engine.add_lora(name, str(real))
            except LoRAAdapterError as exc:
                raise APIError(
                    400, f"The lora adapter '{name}' was not loaded: {exc}", param="lora_path"
                ) from None
            except ValueError as exc:
                raise APIError(400, str(exc), param="lora_name") from None
        log.info("loaded adapter %r from %s", name, real)

    async def unload(self, name: str) -> None:
        from plimsoll.runtime.engine.lora_manager import LoRAInUseError, LoRANotFoundError

        self._check_enabled()
        try:
            await self.engine.remove_lora(name)
        except LoRANotFoundError as exc:
            raise APIError(404, str(exc), param="lora_name") from None
        except LoRAInUseError as exc:
            raise APIError(400, str(exc), param="lora_name",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None  # fmt: skip
        log.info("unloaded adapter %r", name)
