"""The offline API: ``LLM(model=..., **EngineConfig fields).generate(prompts, params)``.

What it is: a thin, vLLM-shaped wrapper over ``LLMEngine`` for scripts and tests.
What it is not: a server; nothing here is concurrent.
"""

from typing import Any

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.outputs import EngineObserver, RequestOutput
from plimsoll.runtime.engine.sampling_params import SamplingParams


class LLM:
    def __init__(
        self, model: str = "smollm2-135m", observer: EngineObserver | None = None, **kwargs: Any
    ) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config, observer)

    def close(self) -> None:
        """Stop tensor-parallel workers, if any; ``with LLM(...) as llm:`` calls it."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        outputs: list[RequestOutput] = self.engine.generate(
            prompts, params if params is not None else SamplingParams()
        )
        return outputs
