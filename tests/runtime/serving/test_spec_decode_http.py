"""Speculative decoding through HTTP: the official openai client gets the tokens it gets without it.

32 greedy completions sent at once (one engine batch) to a server with n-gram
speculation and to one with a draft model, compared with an offline engine that
does not speculate; the spec_decode counters appear on /metrics.
"""

import asyncio
import random
from pathlib import Path
from typing import Any

import openai
import pytest
from server_fixtures import metric, scrape, start_server

from plimsoll.runtime.testing import write_tiny_model

ENGINE = dict(max_model_len=256, kv_cache_memory="4MiB", max_num_seqs=32)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    out = []
    for _ in range(32):
        motif = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 8))]
        out.append((motif * 12)[: rng.randrange(3, 60)])
    return out


async def complete_all(url: str, batch: list[list[int]]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def one(p: list[int]) -> str:
        r = await client.completions.create(
            model=model, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    try:
        return list(await asyncio.gather(*(one(p) for p in batch)))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("spec-http") / "tiny")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_http_greedy_identical_with_speculation(model_dir: Path, method: str) -> None:
    from plimsoll.runtime import LLM, SamplingParams

    batch = prompts()
    ref_llm = LLM(model=str(model_dir), **ENGINE)  # type: ignore[arg-type]
    reference = [
        o.outputs[0].text
        for o in ref_llm.generate(batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ]
    cfg: dict[str, Any] = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
        if method == "ngram"
        else {"model": str(model_dir), "num_speculative_tokens": 3}
    )
    srv = start_server(model_dir, speculative_config=cfg)
    try:
        got = asyncio.run(complete_all(srv.url, batch))
        samples = scrape(srv.url)
    finally:
        srv.stop()
    assert got == reference
    drafts = metric(samples, "plimsoll_spec_decode_num_draft_tokens_total")
    accepted = metric(samples, "plimsoll_spec_decode_num_accepted_tokens_total")
    print(f"{method}: accepted {accepted:.0f} of {drafts:.0f} proposed tokens over HTTP")
    assert drafts > 0 and accepted > 0
    assert metric(samples, "plimsoll_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
