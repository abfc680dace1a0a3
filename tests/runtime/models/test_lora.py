"""LoRA serving in the engine: greedy output per adapter equals transformers + peft.

The base model and two adapters of different ranks and target modules (one on the
fused q/k/v and gate/up projections, one on o/down) run in one concurrent batch,
on random Llama and Qwen2 configs; more adapters than ``max_loras`` all complete
with their swaps counted; a shared prompt's blocks are cached per adapter; a bad
adapter directory is refused, names what is wrong and changes nothing.
"""

import json
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from plimsoll.runtime.testing import write_random_lora

NEW_TOKENS = 12
ADAPTERS = {
    # name: (rank, target modules, lora_alpha)
    "qkv-gateup": (8, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 16.0),
    "o-down": (4, ("o_proj", "down_proj"), 8.0),
    "q-only": (2, ("q_proj",), 4.0),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, name: str) -> Path:
        if (arch, name) not in cache:
            rank, targets, alpha = ADAPTERS[name]
            out = tmp_path_factory.mktemp(f"lora-{arch}-{name}")
            seed = list(ADAPTERS).index(name) + 1
            cache[(arch, name)] = write_random_lora(tiny_model_dir(arch), out, rank, targets, alpha, seed)
        return cache[(arch, name)]

    return get


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.choice([3, 9, 20, 33]))] for _ in range(count)]


def peft_reference(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), attn_implementation="eager", dtype=torch.float32)
    if adapter is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft on a newer transformers
            model = PeftModel.from_pretrained(model, str(adapter))
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            refs.append(out[0, len(p):].tolist())
    return refs


def lora_llm(base: Path, modules: dict[str, Path], **kw: Any) -> Any:
    from plimsoll.runtime import LLM

    args: dict[str, Any] = dict(kv_cache_memory="4MiB", max_model_len=128, enable_lora=True, max_lora_rank=8)
    args.update(kw)
    return LLM(
        model=str(base),
        lora_modules=[{"name": n, "path": str(p)} for n, p in modules.items()],
        **args,
    )


def slots_per_step(llm: Any) -> list[set[int]]:
    """Record the adapter slots of every step's rows (-1 = base) by wrapping the runner."""
    seen: list[set[int]] = []
    execute = llm.engine.runner.execute

    def recording(sched: Any) -> Any:
        seen.append({req.lora_slot for req, _ in sched.scheduled})
        return execute(sched)

    llm.engine.runner.execute = recording
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_equals_peft(arch: str, tiny_model_dir: Any, adapters: Any) -> None:
    from plimsoll.runtime import SamplingParams

    base = tiny_model_dir(arch)
    names = ["qkv-gateup", "o-down"]
    llm = lora_llm(base, {n: adapters(arch, n) for n in names}, max_loras=2)
    prompts = make_prompts(9, seed=7)
    choice: list[str | None] = [[None, *names][i % 3] for i in range(len(prompts))]
    steps = slots_per_step(llm)
    outs = llm.engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), choice)
    got = [o.outputs[0].token_ids for o in outs]
    assert any(len(s) == 3 for s in steps), f"no step mixed the base and both adapters: {steps}"
    refs: dict[str | None, list[list[int]]] = {}
    for who in [None, *names]:
        idx = [i for i, c in enumerate(choice) if c == who]
        refs[who] = peft_reference(base, adapters(arch, who) if who else None, [prompts[i] for i in idx])
        mine = [got[i] for i in idx]
        assert mine == refs[who], f"{arch}: {who or 'base'} differs from transformers+peft"
    # The adapters do change the output (else the test could not fail on a missing delta).
    assert refs[names[0]] != refs[None] and refs[names[1]] != refs[None]
    assert [o.metrics.lora_name for o in outs] == choice


def test_more_adapters_than_slots_all_complete(tiny_model_dir: Any, adapters: Any) -> None:
    from plimsoll.runtime import SamplingParams

    base = tiny_model_dir("llama")
    names = list(ADAPTERS)
    llm = lora_llm(base, {n: adapters("llama", n) for n in names}, max_loras=1, max_cpu_loras=2)
    prompts = make_prompts(6, seed=11)
    choice: list[str | None] = [names[i % 3] for i in range(len(prompts))]
    steps = slots_per_step(llm)
    outs = llm.engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), choice)
    for who in names:
        idx = [i for i, c in enumerate(choice) if c == who]
        ref = peft_reference(base, adapters("llama", who), [prompts[i] for i in idx])
        assert [outs[i].outputs[0].token_ids for i in idx] == ref, f"{who} differs under slot swaps"
    lora = llm.engine.lora
    assert lora.num_swaps >= 3, "three adapters through one slot must load at least three times"
    assert all(s <= {0} for s in steps), f"one slot only: {steps}"
    assert len(lora.host) <= 2  # --max-cpu-loras bounds the host cache; misses were re-read from disk
    assert lora.slot_refs == [0]


def test_prefix_cache_is_per_adapter(tiny_model_dir: Any, adapters: Any) -> None:
    from plimsoll.runtime import SamplingParams

    base = tiny_model_dir("llama")
    llm = lora_llm(base, {n: adapters("llama", n) for n in ("qkv-gateup", "o-down")}, max_loras=2)
    prompt = make_prompts(1, seed=3)[0] * 3  # 60+ tokens: several full blocks
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(lora: str | None) -> int:
        return int(llm.engine.generate([prompt], params, [lora])[0].metrics.num_cached_tokens)

    assert cached("qkv-gateup") == 0
    assert cached("o-down") == 0, "another adapter's KV blocks were reused"
    assert cached(None) == 0, "the base model reused an adapter's KV blocks"
    assert cached("qkv-gateup") > 0, "the same adapter should hit its own cached prefix"


def test_bad_adapter_is_refused_and_nothing_changes(tiny_model_dir: Any, adapters: Any, tmp_path: Path) -> None:
    from plimsoll.runtime import SamplingParams
    from plimsoll.runtime.models.lora import LoRAAdapterError

    base = tiny_model_dir("llama")
    llm = lora_llm(base, {"q-only": adapters("llama", "q-only")})
    good = adapters("llama", "qkv-gateup")
    cases: dict[str, tuple[Path, str]] = {}
    missing = tmp_path / "no-weights"
    missing.mkdir()
    (missing / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    cases["no-weights"] = (missing, "no adapter_model.safetensors")
    cases["nothing"] = (tmp_path / "absent", "is not a directory")
    big = tmp_path / "rank"
    big.mkdir()
    cfg = json.loads((good / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
    cases["rank"] = (big, "--max-lora-rank 8")
    other = tmp_path / "other-base"
    other.mkdir()
    (other / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = load_file(str(good / "adapter_model.safetensors"))
    save_file({k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in state.items()},
              str(other / "adapter_model.safetensors"))
    cases["shape"] = (other, "another base model")
    for name, (path, words) in cases.items():
        with pytest.raises(LoRAAdapterError, match=words.replace("-", r"\-")):
            llm.engine.add_lora(name, str(path))
    assert [lora.lora_name for lora in llm.engine.list_loras()] == ["q-only"]
    out = llm.engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), ["q-only"])
    assert len(out[0].outputs[0].token_ids) == 3


def test_unload_in_flight_is_refused_then_allowed(tiny_model_dir: Any, adapters: Any) -> None:
    from plimsoll.runtime import SamplingParams
    from plimsoll.runtime.engine.lora_manager import LoRAInUseError, LoRANotFoundError

    llm = lora_llm(tiny_model_dir("llama"), {"q-only": adapters("llama", "q-only")})
    engine = llm.engine
    engine.add_request("r1", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4), lora_name="q-only")
    engine.step()
    with pytest.raises(LoRAInUseError, match="1 request"):
        engine.remove_lora("q-only")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("q-only")
    assert engine.list_loras() == []
    with pytest.raises(LoRANotFoundError, match="cannot be found"):
        engine.add_request("r2", [5], SamplingParams(max_tokens=1), lora_name="q-only")


def test_lora_module_flags_parse_like_vllm() -> None:
    from plimsoll.runtime.serve_args import ServeArgError, expand_multi_value_flags, parse_lora_module

    argv = ["serve", "/m", "--enable-lora", "--lora-modules", "a=/p", '{"name": "b", "path": "/q"}', "--port", "1"]
    assert expand_multi_value_flags(argv) == [
        "serve", "/m", "--enable-lora", "--lora-modules", "a=/p", "--lora-modules", '{"name": "b", "path": "/q"}',
        "--port", "1",
    ]
    assert parse_lora_module("a=/p") == {"name": "a", "path": "/p"}
    assert parse_lora_module('{"name": "b", "path": "/q"}') == {"name": "b", "path": "/q"}
    for bad, words in (("nopath", "not name=path"), ('{"name": "b"}', '"name" and "path"'), ("{x", "not valid JSON")):
        with pytest.raises(ServeArgError, match=words):
            parse_lora_module(bad)


def test_lora_info_gauge_in_both_families() -> None:
    from plimsoll.runtime.engine.outputs import EngineStats
    from plimsoll.runtime.serving.metrics import ServerMetrics

    metrics = ServerMetrics("base", metrics_compat="vllm")
    stats = EngineStats(1, 2, 0.1, 10, 9, 16, True, max_loras=4, running_lora_adapters=["a", "b"],
                        waiting_lora_adapters=["c"])
    metrics.refresh(stats)
    metrics.refresh(stats)
    text = metrics.exposition()[0].decode()
    for name in ("plimsoll_lora_requests_info", "vllm:lora_requests_info"):
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert len(lines) == 1, lines
        assert 'running_lora_adapters="a,b"' in lines[0] and 'waiting_lora_adapters="c"' in lines[0]
        assert 'max_lora="4"' in lines[0] and float(lines[0].split()[-1]) > 1.7e9
