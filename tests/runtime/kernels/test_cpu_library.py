"""Loading the prebuilt CPU kernels (``kernels/cpu_library.py``): bound from one header, checked first.

- The binding is the header's: every function ``plimsoll_kernels.h`` declares is exported by
  every installed build with the types read from it, and every C function the sources define is
  declared there (so none is called with argument types written by hand).
- A build is refused, with a message saying what to do, when its file or a directory it is
  reached through is writable by group or others or owned by another user, when it was built
  from other sources or flags than those beside it, when it is missing, or when this CPU lacks
  the instructions it was compiled for.
- A fresh process with no C++ compiler anywhere (``PATH`` stripped, ``CXX``/``CC`` pointing at
  nothing) loads the installed build and serves a tiny model's decode steps through it.
"""

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_builds import INSTALLED, RUNNABLE, needs_kernels

from plimsoll.runtime.kernels import cpu_library, cpu_variants

pytestmark = needs_kernels


def copy_build(variant: str, directory: Path) -> Path:
    """A copy of the installed ``variant`` build (and the OpenMP region library) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    for name in (next(v for v in cpu_variants.variants_for(platform.machine()) if v.name == variant).library,
                 cpu_variants.OPENMP_LIBRARY):  # fmt: skip
        shutil.copyfile(cpu_library.PACKAGE_DIR / name, directory / name)
        (directory / name).chmod(0o755)
    return directory


def test_every_declared_function_is_bound_in_every_installed_build() -> None:
    header = cpu_library.HEADER.read_text()
    declared = re.findall(r"^PLIMSOLL_API [^;]*?\b(plimsoll_\w+)\(", header, flags=re.M | re.S)
    signatures = cpu_library.signatures()
    assert sorted(signatures) == sorted(declared) and len(declared) >= 25
    # Every C function the families define is one the header declares (the compiler then holds
    # each definition to its declaration: C linkage allows no second signature).
    defined = {
        name
        for source in cpu_variants.SOURCES
        for name in re.findall(r'extern "C" [^(]*?\b(plimsoll_\w+)\(', (cpu_variants.CSRC / source).read_text())
    }
    assert defined == set(declared)
    result, args = signatures["plimsoll_packed_linear_f32"]
    assert result is cpu_library.ctypes.c_int
    assert args[:2] == [cpu_library.ctypes.c_void_p, cpu_library.ctypes.c_int64] and len(args) == 12
    for variant in RUNNABLE:
        lib = cpu_library.load(variant)
        assert lib.plimsoll_kernels_variant().decode() == variant
        for name, (result, args) in signatures.items():
            fn = getattr(lib, name)
            assert (fn.restype, list(fn.argtypes)) == (result, args), name


def test_a_type_the_binding_does_not_know_is_an_error(tmp_path: Path) -> None:
    header = tmp_path / "plimsoll_kernels.h"
    header.write_text("PLIMSOLL_API int plimsoll_odd(long double x);\n")
    with pytest.raises(ValueError, match="no ctypes binding for the C type 'long double'"):
        cpu_library.signatures(header)


def test_a_build_others_can_write_or_own_is_refused(tmp_path: Path) -> None:
    variant = RUNNABLE[-1]
    good = copy_build(variant, tmp_path / "good")
    assert cpu_library.load(variant, good).variant == variant
    shared = copy_build(variant, tmp_path / "group-writable")
    shared.chmod(0o775)
    with pytest.raises(cpu_library.KernelsUnavailable, match=r"writable by group or others \(mode 775\); run chmod go-w"):
        cpu_library.load(variant, shared)
    world = copy_build(variant, tmp_path / "world-writable-file")
    next(world.glob("libplimsoll_cpu_*.so")).chmod(0o757)
    with pytest.raises(cpu_library.KernelsUnavailable, match="writable by group or others"):
        cpu_library.load(variant, world)
    # Reached through a symbolic link: the link's directory and the target's are both checked.
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o777)
    linked.chmod(0o777)
    lib_name = next(good.glob("libplimsoll_cpu_*.so")).name
    (linked / lib_name).symlink_to(good / lib_name)
    with pytest.raises(cpu_library.KernelsUnavailable, match=f"directory {linked} is writable"):
        cpu_library.check_trusted(linked / lib_name)
    if os.getuid() != 0:
        return  # only root can hand a file to another user
    foreign = copy_build(variant, tmp_path / "foreign")
    os.chown(next(foreign.glob("libplimsoll_cpu_*.so")), 4242, 4242)
    with pytest.raises(cpu_library.KernelsUnavailable, match="owned by uid 4242, not this user"):
        cpu_library.load(variant, foreign)


def test_a_build_from_other_sources_or_a_missing_one_is_refused(tmp_path: Path) -> None:
    variant = RUNNABLE[-1]
    stale = copy_build(variant, tmp_path / "stale")
    lib = next(stale.glob("libplimsoll_cpu_*.so"))
    spec = next(v for v in cpu_variants.variants_for(platform.machine()) if v.name == variant)
    digest = cpu_variants.build_hash(spec).encode()
    data = lib.read_bytes()
    assert data.count(digest) == 1
    lib.write_bytes(data.replace(digest, b"0" * len(digest)))  # as if built from an older checkout
    with pytest.raises(cpu_library.KernelsUnavailable, match=r"built from other sources or flags .* reinstall plimsoll"):
        cpu_library.load(variant, stale)
    with pytest.raises(cpu_library.KernelsUnavailable, match=r"is not installed in .* reinstall with g\+\+ present"):
        cpu_library.load(variant, tmp_path / "empty")
    if cpu_library.torch_libgomp() is not None:  # a shared object that loads here but is no build of the kernels
        alien = copy_build(variant, tmp_path / "alien")
        shutil.copyfile(alien / cpu_variants.OPENMP_LIBRARY, alien / spec.library)
        with pytest.raises(cpu_library.KernelsUnavailable, match="carries no build hash; reinstall plimsoll"):
            cpu_library.load(variant, alien)


def test_a_build_this_cpu_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_variants.is_x86(platform.machine()):
        pytest.skip("one plain build off x86")
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: frozenset({"sse2"}))
    assert [v.name for v in cpu_library.best_variants()] == ["plain"]
    with pytest.raises(cpu_library.KernelsUnavailable, match=r"cannot run the avx512 build .*avx512f"):
        cpu_library.load.__wrapped__("avx512")


LOAD_WITHOUT_A_COMPILER = """
import shutil, sys
compilers = [shutil.which(c) for c in ("c++", "g++", "gcc", "cc", "clang", "clang++")]
assert compilers == [None] * 6, compilers
from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.testing import write_tiny_model
llm = LLM(model=str(write_tiny_model(sys.argv[1])), kv_cache_memory=4 << 20, max_model_len=128)
paths = []
step = llm.engine.step
def recorded():
    out = step()
    paths.append(llm.engine.runner.last_path)
    return out
llm.engine.step = recorded
llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
lib = cpu_kernels.library()
print(lib.variant, lib.path, ",".join(paths))
"""


def test_the_kernels_load_and_serve_in_a_process_without_a_compiler(tmp_path: Path) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {
        "PATH": str(empty_bin),
        "CXX": str(tmp_path / "no-such-compiler"),
        "CC": str(tmp_path / "no-such-compiler"),
        "HOME": os.environ.get("HOME", str(tmp_path)),
    }
    run = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_A_COMPILER, str(tmp_path / "tiny")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    variant, path, paths = run.stdout.split()[-3:]
    assert variant == RUNNABLE[0] and variant in INSTALLED
    assert Path(path).parent.resolve() == cpu_library.PACKAGE_DIR.resolve()  # the installed build
    assert "fused_decode" in paths.split(","), paths  # decode steps ran through the kernels
