"""Prefix caching really reuses KV: a batch sharing a 512-token prefix computes it once."""

import random
from typing import Any

from plimsoll.runtime.engine.outputs import RequestOutput, StepStats

PREFIX, SUFFIX, BATCH = 512, 20, 8


class Counter:
    def __init__(self) -> None:
        self.prefill = self.queries = self.hits = 0

    def on_step(self, stats: StepStats) -> None:
        self.prefill += stats.num_prefill_tokens
        self.queries += stats.prefix_cache_queries
        self.hits += stats.prefix_cache_hits

    def on_request_finished(self, output: RequestOutput) -> None:
        pass


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 259) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, 259) for _ in range(SUFFIX)] for _ in range(BATCH)]


def test_shared_prefix_is_computed_once(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    batch = prompts(1)
    on, off = Counter(), Counter()
    cached = LLM(model=str(tiny_model_dir("llama")), observer=on, kv_cache_memory="8MiB")
    uncached = LLM(
        model=str(tiny_model_dir("llama")), observer=off, kv_cache_memory="8MiB", enable_prefix_caching=False
    )
    out_on = cached.generate(batch, params)
    out_off = uncached.generate(batch, params)

    # All 8 prompts arrive at once; the first computes the prefix, the other 7 hit it
    # (in the same step: its blocks are registered as soon as they are scheduled).
    print(f"prefill tokens: caching on {on.prefill}, off {off.prefill}; hits {on.hits} of {on.queries}")
    assert on.prefill == PREFIX + BATCH * SUFFIX
    assert off.prefill == BATCH * (PREFIX + SUFFIX)
    assert on.hits == (BATCH - 1) * PREFIX
    assert on.queries == BATCH * (PREFIX + SUFFIX)
    assert [o.metrics.num_cached_tokens for o in out_on] == [0] + [PREFIX] * (BATCH - 1)
    assert [o.outputs[0].token_ids for o in out_on] == [o.outputs[0].token_ids for o in out_off]

    # Later, with every request finished, the blocks are free but still cached.
    on.prefill = 0
    later = cached.generate([batch[0][:PREFIX] + [7] * SUFFIX], params)[0]
    assert later.metrics.num_cached_tokens == PREFIX
    assert on.prefill == SUFFIX
