"""plimsoll.runtime: the inference engine and OpenAI-compatible server.

``from plimsoll.runtime import LLM, SamplingParams`` is the offline API; heavy
modules (torch, transformers) load only when ``LLM`` is first used.
"""

from typing import TYPE_CHECKING, Any

from plimsoll.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plimsoll.runtime.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from plimsoll.runtime.llm import LLM

        return LLM
    raise AttributeError(f"module 'plimsoll.runtime' has no attribute {name!r}")
