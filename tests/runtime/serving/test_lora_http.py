"""LoRA through HTTP with the official openai client: adapters picked by `model`, loaded and
unloaded at run time, listed by /v1/models, counted in /metrics; errors in OpenAI's shape.

The server runs three adapters through two slots (``--max-loras 2``), so a concurrent
mix of the base model and the three adapters both shares steps and swaps adapters.
"""

import asyncio
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_fixtures import chat_model_dir, metric, scrape, start_server  # noqa: F401  (fixture)

from plimsoll.runtime.testing import ThreadedServer, write_random_lora

ADAPTERS = {"sql": (8, ("q_proj", "k_proj", "v_proj", "o_proj")), "chat": (4, ("gate_proj", "up_proj", "down_proj")),
            "tiny": (2, ("v_proj",))}
PROMPTS = [[5, 17, 33, 90, 101], [200, 3, 44], [70, 71, 72, 73, 74, 75, 76], [9, 8]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lora_dirs(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    return {
        name: write_random_lora(chat_model_dir, tmp_path_factory.mktemp(f"http-lora-{name}"), r, targets, 2.0 * r, i)
        for i, (name, (r, targets)) in enumerate(ADAPTERS.items())
    }


ADMIN = {"Authorization": "Bearer admin-key"}
MAX_REGISTERED = 4


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one directory run-time loads may read from (adapters written by tests go under it)."""
    return tmp_path_factory.mktemp("allowed-adapters")


@pytest.fixture(scope="module")
def lora_server(chat_model_dir: Path, lora_dirs: dict[str, Path], lora_root: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(
        chat_model_dir,
        server={"admin_api_key": "admin-key", "allow_runtime_lora_updating": True,
                "lora_allowed_roots": (str(lora_root),), "max_registered_loras": MAX_REGISTERED},
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[{"name": n, "path": str(p)} for n, p in lora_dirs.items()],
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(lora_server: ThreadedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def peft_texts(base: Path, adapter: Path | None) -> list[str]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(model, str(adapter))
    tok = AutoTokenizer.from_pretrained(str(base))
    texts = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            texts.append(tok.decode(out[0, len(p):].tolist(), skip_special_tokens=True))
    return texts


def test_models_lists_adapters_with_their_parent(client: openai.OpenAI, lora_server: ThreadedServer,
                                                 lora_dirs: dict[str, Path]) -> None:
    cards = {m.id: m for m in client.models.list().data}
    base = lora_server.engine.model_name
    assert set(cards) == {base, *ADAPTERS}
    admin_view = {m["id"]: m for m in httpx.get(f"{lora_server.url}/v1/models", headers=ADMIN).json()["data"]}
    for name, path in lora_dirs.items():
        assert cards[name].parent == base  # type: ignore[attr-defined]
        # Paths are the admin key holder's to read (the operator compares them with its spec).
        assert cards[name].root == name  # type: ignore[attr-defined]
        assert admin_view[name]["root"] == str(path)
    assert not any(str(p) in str(cards[base]) for p in lora_dirs.values())


def test_concurrent_mix_equals_peft_and_is_counted(
    lora_server: ThreadedServer, chat_model_dir: Path, lora_dirs: dict[str, Path]  # noqa: F811
) -> None:
    base = lora_server.engine.model_name
    models = [base, *ADAPTERS]

    async def run() -> dict[str, list[str]]:
        async with openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0) as c:
            async def one(model: str, prompt: list[int]) -> str:
                r = await c.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
                assert r.model == model
                return r.choices[0].text

            jobs = [one(m, p) for m in models for p in PROMPTS]
            texts = await asyncio.gather(*jobs)
        return {m: list(texts[i * len(PROMPTS):(i + 1) * len(PROMPTS)]) for i, m in enumerate(models)}

    before = scrape(lora_server.url)
    got = asyncio.run(run())
    for model in models:
        ref = peft_texts(chat_model_dir, lora_dirs.get(model))
        # Byte-level tokens: the stream holds back a trailing incomplete UTF-8 sequence that a
        # one-shot decode renders as U+FFFD (token-exact parity is tests/runtime/models/test_lora.py).
        assert [t.rstrip("\ufffd") for t in got[model]] == [t.rstrip("\ufffd") for t in ref], (
            f"{model} over HTTP differs from transformers+peft"
        )
    assert got[base] != got["sql"] and got[base] != got["chat"]
    after = scrape(lora_server.url)
    for name in ADAPTERS:
        counted = metric(after, "plimsoll_lora_requests_total", lora_name=name) - metric(
            before, "plimsoll_lora_requests_total", lora_name=name)
        assert counted == len(PROMPTS), name
    # Three adapters through two slots: at least one swap beyond the first loads.
    assert metric(after, "plimsoll_lora_swaps_total") >= 3
    info = [k for k in after if k.startswith("plimsoll_lora_requests_info{")]
    assert len(info) == 1 and "max_lora=2" in info[0], info
    assert after[info[0]] > 1.7e9  # a unix timestamp, as GIE reads it


def test_load_use_unload_at_run_time(client: openai.OpenAI, lora_server: ThreadedServer,
                                     chat_model_dir: Path, lora_root: Path) -> None:  # noqa: F811
    path = write_random_lora(chat_model_dir, lora_root / "late", 4, ("q_proj", "down_proj"), 8.0, seed=9)
    url = lora_server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(path)}, headers=ADMIN)
    assert r.status_code == 200, r.text
    full = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "more", "lora_path": str(path)},
                      headers=ADMIN)  # fmt: skip
    assert full.status_code == 400, full.text  # three at start + "late" fill --max-registered-loras 4
    assert f"--max-registered-loras {MAX_REGISTERED}" in full.json()["error"]["message"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(path)},
                       headers=ADMIN)  # fmt: skip
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert "late" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="late", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert out.model == "late" and out.usage is not None and out.usage.completion_tokens >= 1
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert "late" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="late", prompt=[5, 6, 7], max_tokens=4)
    err = info.value.body
    assert isinstance(err, dict) and err["type"] == "NotFoundError" and err["code"] == 404
    assert "late" in err["message"] and "sql" in err["message"]  # names what exists
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ADMIN)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_bad_adapter_dir_is_a_400_and_nothing_changes(client: openai.OpenAI, lora_server: ThreadedServer,
                                                      lora_dirs: dict[str, Path], lora_root: Path) -> None:
    broken = lora_root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((lora_dirs["sql"] / "adapter_config.json").read_text())
    before = {m.id for m in client.models.list().data}
    r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)},
                   headers=ADMIN)  # fmt: skip
    assert r.status_code == 400
    body = r.json()["error"]
    assert body["type"] == "BadRequestError" and "adapter_model.safetensors" in body["message"]
    assert {m.id for m in client.models.list().data} == before
    ok = client.completions.create(model="sql", prompt=[5, 6], max_tokens=3, temperature=0)
    assert ok.model == "sql" and ok.usage is not None and ok.usage.completion_tokens >= 1


def test_runtime_loading_needs_the_admin_key(lora_server: ThreadedServer, lora_dirs: dict[str, Path]) -> None:
    body = {"lora_name": "x", "lora_path": str(lora_dirs["sql"])}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for endpoint in ("load_lora_adapter", "unload_lora_adapter"):
            r = httpx.post(f"{lora_server.url}/v1/{endpoint}", json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert "admin key" in r.json()["error"]["message"]


def test_paths_outside_the_allowed_roots_get_one_answer(lora_server: ThreadedServer, lora_root: Path,
                                                        lora_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Existing or not, a directory or not, a symlink out of the root: the same 400, nothing that maps the disk."""
    (lora_root / "escape").symlink_to(lora_dirs["sql"], target_is_directory=True)  # a real adapter, outside
    answers = set()
    for path in ("/etc", "/nonexistent-dir-xyz", "/etc/passwd", str(lora_dirs["sql"]), str(lora_root / "escape"),
                 "relative/path", str(lora_root / ".." / lora_dirs["sql"].name)):  # fmt: skip
        r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path},
                       headers=ADMIN)  # fmt: skip
        assert r.status_code == 400, (path, r.text)
        answers.add(r.json()["error"]["message"])
    assert len(answers) == 1 and "--lora-allowed-roots" in answers.pop()


def test_runtime_updating_is_opt_in() -> None:
    import types

    from plimsoll.runtime.serving.errors import APIError
    from plimsoll.runtime.serving.lora_admin import LoRAAdmin
    from plimsoll.runtime.serving.settings import ServerSettings

    engine: Any = types.SimpleNamespace(config=types.SimpleNamespace(enable_lora=True), is_ready=True)
    admin = LoRAAdmin(engine, ServerSettings(served_model_name="m"))
    for call in (admin.load("a", "/x"), admin.unload("a")):
        with pytest.raises(APIError) as refused:
            asyncio.run(call)
        assert refused.value.status == 404 and "--allow-runtime-lora-updating" in refused.value.message


def test_lora_endpoints_refused_without_enable_lora(chat_model_dir: Path) -> None:  # noqa: F811
    srv = start_server(chat_model_dir)
    try:
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_streaming_chat_under_an_adapter_reports_it(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks and all(c.model == "chat" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    base = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True},
    )
    assert text != base.choices[0].message.content  # the adapter, not the base model, answered
