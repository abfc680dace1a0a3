"""``kernels/host_memory.keep_freed_memory``: a step's large buffers reuse the pages of the step before.

Counted, not timed: the minor page faults (``getrusage``) of a second, identical prefill step
of the embedded SmolLM2 on the module path after warm-up (512 tokens: matmul outputs of 1-6 MiB), in a fresh
process with the thresholds set and in one without (``EngineConfig.keep_freed_memory``). And
when it must leave malloc alone: another allocator loaded, or (``plimsoll serve``'s edge)
malloc settings in the environment.
"""

import ctypes
import mmap
import os
import resource
import subprocess
import sys

import pytest

from plimsoll.runtime.kernels import host_memory

SCRIPT = """
import random, resource, sys
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.kernels import host_memory
# The module path (as with adapters or int8 projections): the glued layers' 256-row chunks reuse
# their few buffer sizes whatever the thresholds, so they would show nothing.
engine = LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512,
                                enable_prefix_caching=False, max_num_batched_tokens=512,
                                keep_freed_memory=sys.argv[1] == "1", cpu_glued_layers=False))
rng = random.Random(0)
def prefill(tag):
    for i in range(4):
        engine.add_request(f"{tag}{i}", [rng.randrange(100, 40000) for _ in range(128)], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
engine.warmup()
prefill("a")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
prefill("b")
print(host_memory._applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


def counts_minor_faults() -> bool:
    """Whether this kernel counts minor page faults: touching 16 MiB of fresh anonymous memory must.

    Some sandboxes' kernels (gVisor's, for one) leave ``ru_minflt`` at 0 whatever happens.
    """
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with mmap.mmap(-1, 16 << 20) as fresh:
        for offset in range(0, 16 << 20, mmap.PAGESIZE):
            fresh[offset] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before >= 1000


@pytest.mark.skipif(not glibc(), reason="the thresholds are glibc's")
@pytest.mark.skipif(not counts_minor_faults(), reason="this kernel does not count minor page faults (ru_minflt)")
def test_a_second_prefill_step_faults_in_no_fresh_pages() -> None:
    faults = {}
    for keep in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", SCRIPT, keep], capture_output=True, text=True, check=True)
        applied, count = out.stdout.split()[-2:]
        assert applied == (str(True) if keep == "1" else "None")  # None: never called
        faults[keep] = int(count)
    print(
        f"minor page faults in the second 512-token prefill step: kept {faults['1']}, not kept {faults['0']}"
    )
    assert faults["0"] > 1000  # ~9,000 here: each multi-MiB output faulted in afresh
    assert faults["1"] < faults["0"] / 10


def test_leaves_malloc_alone_where_another_allocator_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    maps = "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4.5.9\n"
    why = host_memory._why_not(maps)
    assert why is not None and "tcmalloc" in why
    assert host_memory._why_not("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/libc.so.6\n") is None
    monkeypatch.setattr(host_memory, "_why_not", lambda: why)
    monkeypatch.setattr(host_memory, "_applied", None)
    assert host_memory.keep_freed_memory() is False


@pytest.mark.parametrize(
    ("env", "named"),
    [({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"), ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES")],
)
def test_serve_leaves_malloc_alone_where_the_environment_configures_it(
    env: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `plimsoll serve` reads its environment at the edge and sets EngineConfig.keep_freed_memory.
    from plimsoll.runtime.serve_args import environment_malloc_settings

    for key in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES"]:
        monkeypatch.delenv(key, raising=False)
    assert environment_malloc_settings() is None
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    why = environment_malloc_settings()
    assert why is not None and named in why
