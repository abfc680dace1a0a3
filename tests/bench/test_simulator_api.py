"""The simulator speaks the OpenAI API as the official client expects, and bench drives both endpoints."""

import httpx
import openai
import pytest
from benchkit import sim_config

from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, serving_simulator
from plimsoll.metric_names import VLLM, detect_family
from plimsoll.prometheus import parse


async def test_official_openai_client_streams_from_the_simulator() -> None:
    async with serving_simulator(ServiceCurve(step_t0_s=0.005)) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        stream = await client.completions.create(
            model="sim-model",
            prompt="a b c d",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts, usage = [], None
        async for chunk in stream:
            texts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert len(texts) == 5 and usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (4, 5)
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content == " tok tok tok"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x", max_tokens=1)
        await client.close()


async def test_chat_endpoint_level_with_repeats() -> None:
    async with serving_simulator(ServiceCurve(step_t0_s=0.01)) as url:
        session = await BenchSession.open(
            sim_config(url, (2,), endpoint="chat", repeats=2, duration_per_level_s=0.4)
        )
        try:
            lv = await session.level(2)
        finally:
            await session.aclose()
    assert lv["repeats"] == 2 and len(session.runs) == 2
    assert lv["requests"]["completed"] > 0 and lv["tokens"]["output_mean"] == 4
    assert lv["throughput"]["output_tokens_per_s_min"] <= lv["throughput"]["output_tokens_per_s"]


async def test_malformed_requests_get_openai_style_400s() -> None:
    bad = [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b'{"model": "sim-model"}', "prompt"),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "hi", "max_tokens": -3}', "max_tokens"),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "hi", "max_tokens": "5"}', "max_tokens"),
        ("/v1/chat/completions", b'{"model": "sim-model", "messages": []}', "messages"),
    ]
    async with serving_simulator(ServiceCurve(step_t0_s=0.005)) as url, httpx.AsyncClient() as http:
        for path, body, param in bad:
            response = await http.post(url + path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["error"]["param"] == param


async def test_vllm_flavour_speaks_vllm_metric_names_and_has_no_ready() -> None:
    async with (
        serving_simulator(ServiceCurve(step_t0_s=0.005, engine="vllm")) as url,
        httpx.AsyncClient() as http,
    ):
        answer = await http.post(
            url + "/v1/completions", json={"model": "sim-model", "prompt": "a b", "max_tokens": 2}
        )
        assert answer.status_code == 200
        assert (await http.get(url + "/ready")).status_code == 404
        scrape = parse((await http.get(url + "/metrics")).text)
    assert detect_family(scrape.names()) is VLLM
    assert scrape.sum(VLLM.request_success) == 1 and scrape.sum(VLLM.generation_tokens) == 2
    assert not any(name.startswith("plimsoll_") for name in scrape.names())
    with pytest.raises(ValueError, match="engine must be one of"):
        ServiceCurve(engine="tgi")
