"""With speculative decoding on, a fault in one request's sampling fails that request only.

Two injected faults, each keyed to one request's seed: one raises while the target
verifies that request's proposals (the rejection sampler's path), one raises in the
plain sampler (a request that carried no proposals this step). Every other request
in the same batches finishes with exactly the tokens it gets when nothing fails
(seeded, so batch-independent), and the engine keeps serving.
"""

from typing import Any

from test_spec_greedy import NGRAM, mixed_prompts

from plimsoll.runtime.engine.spec_decode.speculator import Speculator

VERIFY_POISON, SAMPLER_POISON = 666, 667


def sampled_params(count: int) -> list[Any]:
    from plimsoll.runtime import SamplingParams

    return [
        SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=24, ignore_eos=True) for i in range(count)
    ]


class PoisonedSampler:
    """The engine's sampler, except that sampling a batch holding the SAMPLER_POISON seed raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample_device(self, reqs: list[Any], logits: Any) -> Any:
        if any(r.params.seed == SAMPLER_POISON for r in reqs):
            raise FloatingPointError("injected: probabilities are NaN")
        return self.inner.sample_device(reqs, logits)


def test_a_fault_while_verifying_or_sampling_one_request_fails_only_that_request(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM

    prompts = mixed_prompts(1, count=12)
    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="8MiB", speculative_config=NGRAM)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled_params(12))]

    engine = llm.engine
    speculator = engine.speculator
    assert speculator is not None
    verified: list[int] = []
    real_verify = Speculator._verify

    def poisoned_verify(self: Speculator, reqs: list[Any], *args: Any) -> Any:
        verified.extend(r.params.seed for r in reqs)
        if any(r.params.seed == VERIFY_POISON for r in reqs):
            raise RuntimeError("injected: rejection sampler failed")
        return real_verify(self, reqs, *args)

    speculator._verify = poisoned_verify.__get__(speculator)  # type: ignore[method-assign]
    engine.sampler = PoisonedSampler(engine.sampler)  # type: ignore[assignment]
    params = sampled_params(12)
    params[3].seed, params[7].seed = VERIFY_POISON, SAMPLER_POISON
    outputs = llm.generate(prompts, params)

    assert VERIFY_POISON in verified  # the poisoned request did carry proposals to verify
    assert outputs[3].error is not None and "rejection sampler failed" in outputs[3].error
    assert outputs[7].error is not None and "FloatingPointError" in outputs[7].error
    for i, out in enumerate(outputs):
        if i in (3, 7):
            assert out.finished and out.outputs[0].finish_reason == "error"
            continue
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == clean[i]  # untouched by its neighbours' failures
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.usage() == 0.0  # the failed requests' blocks were freed
    again = llm.generate(prompts[:2], sampled_params(2))
    assert [o.outputs[0].token_ids for o in again] == clean[:2]
