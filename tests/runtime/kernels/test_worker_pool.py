"""The compiled kernels' persistent worker pool (``csrc/cpu_kernels.cpp``, ``pool::parallel``).

Every task of a call runs exactly once; the pool's threads are started once per process,
not per call; calls from several Python threads at once (several engines in one process)
all complete with correct results; a forked child (a template worker of ``plimsoll serve``)
builds its own pool and its kernels still compute the right answer.
"""

import os
import shutil
import threading

import pytest
import torch
from torch.nn import functional as F

from plimsoll.runtime.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    (shutil.which("c++") or shutil.which("g++")) is None, reason="no C++ compiler to build the kernels"
)


def test_each_task_runs_once_and_threads_are_started_once() -> None:
    for tasks in (1, 2, 3, 5):
        assert cpu_kernels.pool_noop(tasks) == tasks
    started = cpu_kernels.pool_threads()
    assert started >= 4  # at least the most helpers any call asked for: 5 tasks, the caller runs one
    for _ in range(200):
        assert cpu_kernels.pool_noop(5) == 5
    assert cpu_kernels.pool_threads() == started
    assert cpu_kernels.pool_noop(4, use_pool=False) == 4  # the per-call threads it replaced


def test_concurrent_callers_get_correct_results() -> None:
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
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(1)
    assert not errors, errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_builds_its_own_pool() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 256), torch.randn(2048, 256)
    assert cpu_kernels.pool_noop(3) == 3  # the parent's pool has helpers before the fork
    expected = F.linear(x, w)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the parent's pool names threads that are not here
        ok = cpu_kernels.pool_noop(3) == 3
        torch.set_num_threads(2)
        ok = ok and torch.allclose(cpu_kernels.small_batch_linear(x, w, None), expected, rtol=1e-4, atol=1e-4)
        os.write(write, b"ok" if ok and cpu_kernels.pool_threads() >= 2 else b"bad")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 8)
    os.close(read)
    assert status == 0 and answer == b"ok", (status, answer)
