"""How the compiled kernels split a call over threads (``csrc/pool.cpp``, ``pool::parallel``).

Where torch's OpenMP runtime is GNU libgomp loaded as ``libgomp.so.1`` (the pip wheels), the
kernels get their parallel region from ``libplimsoll_openmp.so``, which binds to that same copy
(the kernels themselves need no OpenMP runtime): one runtime in the process, and each call a
parallel region on the team oneDNN's matmuls use. ``select``'s ``parallel`` (the engine's
``cpu_kernel_parallel``) picks another mode, and names a mode it cannot run. Otherwise, and in a forked
child, the kernels' own persistent pool. In every mode each task of a call runs exactly once;
the pool's threads are started once per process, not per call; calls from several Python
threads at once (several engines in one process) all complete with correct results; a forked
child's kernels switch to the pool, which builds itself anew there, and still compute the right
answer (torch's own OpenMP matmuls hang in such a child: GNU libgomp cannot run there).
"""

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kernel_builds import needs_kernels
from torch.nn import functional as F

from plimsoll.runtime.kernels import cpu_kernels, cpu_library, cpu_variants

pytestmark = needs_kernels


@pytest.fixture
def pool_mode() -> Iterator[None]:
    before = cpu_kernels.parallel_mode("pool")
    try:
        yield
    finally:
        cpu_kernels.parallel_mode(before)


def needed_libraries(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout


def test_the_kernels_share_torchs_openmp_runtime_where_it_is_libgomp() -> None:
    lib = cpu_kernels.select()
    assert lib.library is not None, lib.reason
    assert "libgomp" not in needed_libraries(lib.library.path)  # the kernels need no OpenMP runtime
    gomp = cpu_library.torch_libgomp()
    if gomp is None:
        assert not lib.library.openmp and cpu_kernels.parallel_mode() == "pool"
        assert "openmp" not in cpu_kernels.available_parallel_modes()
        return
    assert lib.library.openmp and cpu_kernels.parallel_mode() == "openmp"  # the default
    assert cpu_kernels.available_parallel_modes() == {"threads", "pool", "openmp"}
    region = needed_libraries(cpu_library.PACKAGE_DIR / cpu_variants.OPENMP_LIBRARY)
    assert "libgomp.so.1" in region, region  # bound by soname, so to the copy torch loaded
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert loaded == {str(gomp)}, loaded  # one OpenMP runtime in the process, torch's
    for tasks in (1, 2, 3, 5, 64):
        assert cpu_kernels.pool_noop(tasks) == tasks  # each task once, whatever the team's size
    with pytest.raises(ValueError, match="parallel mode 'fibers'"):
        cpu_kernels.parallel_mode("fibers")


@pytest.mark.parametrize(("wanted", "expected"), [("pool", "pool"), ("threads", "threads"), ("fibers", None)])
def test_the_selection_chooses_the_mode(wanted: str, expected: str | None, caplog: pytest.LogCaptureFixture) -> None:
    default = "openmp" if cpu_library.torch_libgomp() is not None else "pool"
    try:
        with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
            cpu_kernels.select("auto", wanted)
        assert cpu_kernels.parallel_mode() == (expected or default)
        if expected is None:  # an unknown mode is named, and the default kept
            assert any("parallel mode 'fibers'" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        cpu_kernels.select()
    assert cpu_kernels.parallel_mode() == default


def test_results_are_the_same_in_every_mode() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 512), torch.randn(1024, 512)
    before = cpu_kernels.parallel_mode()
    torch.set_num_threads(2)
    try:
        got = {}
        for mode in sorted(cpu_kernels.available_parallel_modes()):
            cpu_kernels.parallel_mode(mode)
            got[mode] = cpu_kernels.small_batch_linear(x, w, None)
    finally:
        cpu_kernels.parallel_mode(before)
        torch.set_num_threads(1)
    expected = F.linear(x, w)
    for mode, y in got.items():
        assert torch.allclose(y, expected, rtol=1e-4, atol=1e-4), mode
        assert torch.equal(y, got["pool"]), mode  # the same split, so the same sums


def test_each_task_runs_once_and_threads_are_started_once(pool_mode: None) -> None:
    for tasks in (1, 2, 3, 5):
        assert cpu_kernels.pool_noop(tasks) == tasks
    started = cpu_kernels.pool_threads()
    assert started >= 4  # at least the most helpers any call asked for: 5 tasks, the caller runs one
    for _ in range(200):
        assert cpu_kernels.pool_noop(5) == 5
    assert cpu_kernels.pool_threads() == started
    assert cpu_kernels.pool_noop(4, use_pool=False) == 4  # the per-call threads it replaced


@pytest.mark.parametrize("mode", ["pool", "openmp"])
def test_concurrent_callers_get_correct_results(mode: str) -> None:
    if mode not in cpu_kernels.available_parallel_modes():
        pytest.skip(f"this build has no {mode} mode")
    # One caller owns the pool at a time; the others start threads of their own.
    torch.manual_seed(0)
    x = torch.randn(3, 512)
    weights = [torch.randn(1024, 512) for _ in range(4)]
    expected = [F.linear(x, w) for w in weights]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(30):
            got = cpu_kernels.small_batch_linear(x, weights[i], None)
            if not torch.allclose(got, expected[i], rtol=1e-4, atol=1e-4):
                errors.append(f"caller {i}: max error {(got - expected[i]).abs().max().item():.2e}")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    torch.set_num_threads(2)
    before = cpu_kernels.parallel_mode(mode)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        cpu_kernels.parallel_mode(before)
        torch.set_num_threads(1)
    assert not errors, errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_builds_its_own_pool() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 256), torch.randn(2048, 256)
    before = cpu_kernels.parallel_mode()
    cpu_kernels.parallel_mode("pool")
    assert cpu_kernels.pool_noop(3) == 3  # the parent's pool has helpers before the fork
    cpu_kernels.parallel_mode(before)
    torch.set_num_threads(2)
    assert cpu_kernels.pool_noop(3) == 3  # and, where built with it, OpenMP has a team
    torch.set_num_threads(1)
    expected = F.linear(x, w)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the parent's pool names threads that are not here
        ok = cpu_kernels.parallel_mode() == "pool" and cpu_kernels.pool_noop(3) == 3
        torch.set_num_threads(2)
        ok = ok and torch.allclose(cpu_kernels.small_batch_linear(x, w, None), expected, rtol=1e-4, atol=1e-4)
        os.write(write, b"ok" if ok and cpu_kernels.pool_threads() >= 2 else b"bad")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 8)
    os.close(read)
    assert status == 0 and answer == b"ok", (status, answer)
