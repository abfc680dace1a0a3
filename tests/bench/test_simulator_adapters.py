"""The simulator's LoRA API as vLLM's: adapters at start and at run time, /v1/models parents, the info gauge."""

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from plimsoll.bench.simulator import ServiceCurve, serving_simulator
from plimsoll.metric_names import LORA_REQUESTS_INFO, VLLM_LORA_REQUESTS_INFO
from plimsoll.prometheus import parse


def adapter_dir(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(folder)


def info_labels(text: str, name: str) -> dict[str, str]:
    rows = parse(text).samples.get(name, [])
    assert len(rows) == 1, rows
    return dict(rows[0][0])


async def test_adapters_load_serve_list_and_unload(tmp_path: Path) -> None:
    curve = ServiceCurve(
        step_t0_s=0.01, enable_lora=True, lora_modules=(f"a={adapter_dir(tmp_path, 'a')}",), max_loras=2
    )
    async with serving_simulator(curve) as url, httpx.AsyncClient(base_url=url) as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {"sim-model", "a"}
        assert models["a"].model_extra["parent"] == "sim-model"

        bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="b", prompt="x", max_tokens=1)

        ok = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapter_dir(tmp_path, "b")})
        assert ok.status_code == 200, ok.text
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path / "b")})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

        # Requests in flight under b: the gauge names it, and unloading it is refused meanwhile.
        stream = asyncio.create_task(client.completions.create(model="b", prompt="x y", max_tokens=30))
        for _ in range(200):
            labels = info_labels((await http.get("/metrics")).text, LORA_REQUESTS_INFO)
            if labels["running_lora_adapters"] == "b":
                break
            await asyncio.sleep(0.01)
        assert labels == {"running_lora_adapters": "b", "waiting_lora_adapters": "", "max_lora": "2"}
        busy = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert busy.status_code == 400 and "in flight" in busy.json()["error"]["message"]
        done = await stream
        assert done.model == "b" and done.choices[0].text == " tok" * 30

        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert gone.status_code == 200
        missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
        assert [m.id for m in (await client.models.list()).data] == ["sim-model", "a"]
        await client.close()


async def test_vllm_family_names_the_gauge_vllm_and_lora_off_refuses_loads(tmp_path: Path) -> None:
    async with serving_simulator(ServiceCurve(engine="vllm", enable_lora=True)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            text = (await http.get("/metrics")).text
        assert info_labels(text, VLLM_LORA_REQUESTS_INFO)["max_lora"] == "4"
    async with serving_simulator(ServiceCurve()) as url, httpx.AsyncClient(base_url=url) as http:
        refused = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert refused.status_code == 400 and "--enable-lora" in refused.json()["error"]["message"]
        assert LORA_REQUESTS_INFO not in (await http.get("/metrics")).text


def test_bad_lora_modules_are_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not name=path"):
        ServiceCurve(enable_lora=True, lora_modules=("a",))
    with pytest.raises(ValueError, match="not a directory"):
        ServiceCurve(enable_lora=True, lora_modules=(f"a={tmp_path / 'none'}",))
    with pytest.raises(ValueError, match="need enable_lora"):
        ServiceCurve(lora_modules=(f"a={adapter_dir(tmp_path, 'a')}",))
