"""The prebuilt CPU kernels: which build this CPU runs, checked, loaded and bound.

What it is:
- ``best_variants()``: the builds of ``cpu_variants`` this CPU can run, best first, from the
  flags in ``/proc/cpuinfo`` (elsewhere from ``torch.backends.cpu.get_cpu_capability()``).
- ``load(variant)``: that build's library from the package directory, where ``setup.py`` put
  it at install. Before anything is loaded the file and the directories it is reached through
  must be owned by this user or root and writable by no one else (a library others can
  replace would run their code in this process), and the library must carry the build hash of
  the sources and flags beside it (``cpu_variants.build_hash``; a stale build of an editable
  install is refused, not guessed at). Its C functions are then bound with ctypes from
  ``csrc/plimsoll_kernels.h``: the argument and result types are read from that header, the
  one list of signatures the C++ compiler also holds every definition to.
- Where torch's OpenMP runtime is GNU libgomp loaded as ``libgomp.so.1``,
  ``libplimsoll_openmp.so`` is loaded beside it and its parallel region handed to the kernels,
  so their work runs on the team oneDNN's matmuls use (``csrc/pool.cpp``).
A problem is raised as ``KernelsUnavailable`` carrying one line that says why and what to do.

What it is not: a compiler (nothing is built here, so a serving host needs none), the choice
of which build a process uses (``cpu_kernels.select``), or the torch-shaped calls
(``cpu_kernels``).
"""

import ctypes
import functools
import logging
import os
import platform
import re
import stat
from pathlib import Path

import torch

from plimsoll.runtime.kernels import cpu_variants

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).parent
HEADER = cpu_variants.CSRC / "plimsoll_kernels.h"
# The C types the header may use, and their ctypes; any pointer is a c_void_p (a tensor's data_ptr()).
C_TYPES: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "const char*": ctypes.c_char_p,
}
_DECLARATION = re.compile(
    r"PLIMSOLL_API\s+(?P<result>[\w\s*]+?)\s*\b(?P<name>plimsoll_\w+)\s*\((?P<params>[^)]*)\)\s*;"
)


class KernelsUnavailable(RuntimeError):
    """Why the kernels (or one build of them) cannot be used here; the message is one line."""


class KernelLibrary(ctypes.CDLL):
    """One loaded build, its functions bound (``lib.plimsoll_<name>(...)``)."""

    variant: str
    path: Path
    openmp: bool  # its work runs on torch's OpenMP team (else on its own pool)


def _ctype(declared: str) -> type | None:
    text = " ".join(declared.replace("*", " * ").split()).replace(" *", "*")
    if text in C_TYPES:
        return C_TYPES[text]
    if text.endswith("*"):
        return ctypes.c_void_p
    raise ValueError(f"{HEADER.name}: no ctypes binding for the C type {declared.strip()!r}")


def signatures(header: Path = HEADER) -> dict[str, tuple[type | None, list[type | None]]]:
    """Every ``PLIMSOLL_API`` function of the header: its result type and argument types."""
    text = re.sub(r"//[^\n]*", "", header.read_text())
    found: dict[str, tuple[type | None, list[type | None]]] = {}
    for m in _DECLARATION.finditer(text):
        params = [p.strip() for p in m["params"].split(",") if p.strip() and p.strip() != "void"]
        types = []
        for param in params:
            declared = re.fullmatch(r"(?P<type>.*?[\s*])(?P<name>\w+)", param)
            if declared is None:
                raise ValueError(f"{header.name}: cannot read parameter {param!r} of {m['name']}")
            types.append(_ctype(declared["type"]))
        found[m["name"]] = (_ctype(m["result"]), types)
    return found


def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags of this CPU from ``/proc/cpuinfo`` (``None`` where it is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def missing_for(variant: cpu_variants.Variant) -> set[str]:
    """The CPU features ``variant`` needs that this CPU lacks (empty: it runs here)."""
    flags = cpu_flags()
    if flags is not None:
        return set(variant.cpu_flags - flags)
    order = ("DEFAULT", "AVX2", "AVX512")
    have = torch.backends.cpu.get_cpu_capability()
    return (
        set()
        if order.index(variant.capability) <= (order.index(have) if have in order else 0)
        else {variant.capability}
    )


def best_variants() -> list[cpu_variants.Variant]:
    """The builds this CPU runs, best first."""
    return [v for v in cpu_variants.variants_for(platform.machine()) if not missing_for(v)]


def check_trusted(path: Path) -> None:
    """Raise ``KernelsUnavailable`` unless ``path`` and every directory it is reached through (the
    one it was found in and, for a symbolic link, its target's) are owned by this user or root
    and writable by no one else."""
    uid = os.getuid()
    seen = {path.absolute(), path.absolute().parent, path.resolve(), path.resolve().parent}
    for item in sorted(seen):
        st = item.stat()
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        if st.st_uid not in (uid, 0):
            raise KernelsUnavailable(
                f"refusing {path}: its {kind} {item} is owned by uid {st.st_uid}, not this user ({uid}) or root; "
                "reinstall plimsoll as this user or root"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise KernelsUnavailable(
                f"refusing {path}: its {kind} {item} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):o}); run chmod go-w {item}"
            )


def _open(path: Path) -> KernelLibrary:
    if not path.is_file():
        raise KernelsUnavailable(
            f"{path.name} is not installed in {path.parent} (plimsoll was installed without a C++ compiler, or "
            "its build failed); reinstall with g++ present: pip install builds the kernels"
        )
    check_trusted(path)
    try:
        return KernelLibrary(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"{path.name} does not load: {str(exc).splitlines()[0][:200]}") from None


def _bind(lib: KernelLibrary) -> None:
    for name, (result, args) in signatures().items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise KernelsUnavailable(
                f"{lib.path.name} lacks {name}; reinstall plimsoll to rebuild it"
            ) from None
        fn.restype, fn.argtypes = result, args


@functools.cache
def load(variant: str, directory: Path = PACKAGE_DIR) -> KernelLibrary:
    """The ``variant`` build from ``directory``, checked and bound; raises ``KernelsUnavailable``."""
    known = {v.name: v for v in cpu_variants.variants_for(platform.machine())}
    if variant not in known:
        raise KernelsUnavailable(
            f"no {variant!r} build for a {platform.machine()} CPU; builds: {', '.join(known)}"
        )
    spec = known[variant]
    missing = missing_for(spec)
    if missing:
        raise KernelsUnavailable(
            f"this CPU cannot run the {variant} build (it lacks {', '.join(sorted(missing))})"
        )
    lib = _open(directory / spec.library)
    lib.variant, lib.path, lib.openmp = variant, directory / spec.library, False
    # Read before binding the rest: a stale build's functions may not match the header.
    try:
        lib.plimsoll_kernels_build_hash.restype = ctypes.c_char_p
    except AttributeError:
        raise KernelsUnavailable(
            f"{spec.library} carries no build hash; reinstall plimsoll to rebuild it"
        ) from None
    built, wanted = lib.plimsoll_kernels_build_hash().decode(), cpu_variants.build_hash(spec)
    if built != wanted:
        raise KernelsUnavailable(
            f"{spec.library} was built from other sources or flags than those beside it ({built}, not {wanted}); "
            "reinstall plimsoll (pip install -e . in a checkout) to rebuild it"
        )
    _bind(lib)
    if lib.plimsoll_kernels_variant().decode() != variant:
        raise KernelsUnavailable(f"{spec.library} holds the {lib.plimsoll_kernels_variant().decode()} build")
    _attach_openmp(lib, directory)
    return lib


def torch_libgomp() -> Path | None:
    """The GNU OpenMP runtime torch has loaded, when it is loaded as ``libgomp.so.1``: a library
    that needs ``libgomp.so.1`` then binds to that very copy (the dynamic linker matches the name
    to the one already loaded). ``None`` elsewhere (another runtime, a renamed copy, no ``/proc``)."""
    gomps = _loaded_gomps()
    return next((p for p in gomps if p.name == "libgomp.so.1"), None) if len(gomps) == 1 else None


def _loaded_gomps() -> set[Path]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    fields = (line.split() for line in maps.splitlines())
    return {Path(f[-1]) for f in fields if len(f) >= 6 and "libgomp" in os.path.basename(f[-1])}


def _attach_openmp(lib: KernelLibrary, directory: Path) -> None:
    """Hand ``lib`` the OpenMP region where torch's runtime is ``libgomp.so.1`` (else it keeps its pool)."""
    if torch_libgomp() is None:
        if len(_loaded_gomps()) > 1:
            # Two OpenMP runtimes would be two teams fighting for the cores: the pool instead.
            log.warning("CPU kernels: two OpenMP runtimes loaded (%s); using the kernels' own threads",
                        sorted(map(str, _loaded_gomps())))  # fmt: skip
        return
    try:
        region = _open(directory / cpu_variants.OPENMP_LIBRARY)
    except KernelsUnavailable as exc:
        log.info("CPU kernels: their own threads, not torch's OpenMP team: %s", exc)
        return
    lib.plimsoll_set_openmp_region(ctypes.cast(region.plimsoll_openmp_region, ctypes.c_void_p))
    lib.openmp = True
