"""The engine as the HTTP layer sees it: one typed interface, whatever runs behind it.

What it is: :class:`EngineClient`, a ``typing.Protocol`` that ``AsyncEngine`` (and
any test wrapper around it) satisfies; the server types ``ServingContext.engine``
with it. The server validates every request before calling ``generate``; an engine
behind this interface trusts what it gets. What it is not: an implementation.
"""

from collections.abc import AsyncGenerator
from typing import Any, Protocol, TypedDict, Unpack

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.lora_manager import LoRARequest
from plimsoll.runtime.engine.outputs import EngineStats, RequestOutput
from plimsoll.runtime.engine.request import Continuation
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.ttft_prediction import QueueSnapshot, ServiceRates, TTFTDeadline


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of ``generate`` after the prompt, as layers that pass them on see
    them: the request's scheduling attributes, what it continues and its prefix-cache salt
    (``AsyncEngine.generate`` says what each means and its default)."""

    priority: int
    fairness_id: str | None
    continuation: Continuation | None
    cache_salt: str | None
    ttft_deadline: TTFTDeadline | None


class EngineClient(Protocol):
    config: EngineConfig
    is_ready: bool

    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def is_dead(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def queue_snapshot(self) -> QueueSnapshot: ...

    def service_rates(self) -> ServiceRates | None: ...

    def recent_steps(self, since: float) -> list[tuple[float, int]]: ...

    @property
    def sleep_level(self) -> int: ...

    async def sleep(self, level: int) -> int: ...  # the bytes freed

    async def wake_up(self) -> float: ...  # the seconds it took

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        lora_name: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def list_loras(self) -> list[LoRARequest]: ...

    async def add_lora(self, name: str, path: str) -> LoRARequest: ...

    async def remove_lora(self, name: str) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def cut_streams(self) -> None: ...
