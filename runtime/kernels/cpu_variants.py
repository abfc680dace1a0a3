"""The CPU kernels' builds: which instruction sets, compiled with which flags, into which files.

What it is: data and two small functions read by ``setup.py``, which compiles every variant
when plimsoll is installed (``pip install``, ``pip install -e``, the image's build stage), and
by ``cpu_library.py``, which picks the variant this CPU runs and loads it. On x86-64 three
variants are built: ``avx512`` (x86-64-v4: AVX-512 F/BW/CD/DQ/VL), ``avx2`` (x86-64-v3: AVX2,
FMA, BMI) and ``plain`` (baseline x86-64, SSE2); elsewhere one ``plain`` build for the machine.
The same sources serve all of them (``csrc/simd.h`` picks the vector code by the compiler's
``__AVX512F__``/``__AVX2__``). ``libplimsoll_openmp.so`` (``csrc/openmp_region.cpp``) is built
once, on its own, so that only it depends on the OpenMP runtime. ``build_hash`` is compiled
into each library, and the loader refuses one built from other sources or flags than those beside it.

What it is not: the build itself (``setup.py``) or the loader (``cpu_library.py``). It imports
nothing outside the standard library, so ``setup.py`` can read it before torch is installed.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# One translation unit per family; the headers hold what the families share.
SOURCES = ("pool.cpp", "attention.cpp", "matmul.cpp", "glue.cpp", "decode_step.cpp")
OPENMP_SOURCE = "openmp_region.cpp"
OPENMP_LIBRARY = "libplimsoll_openmp.so"
# -fopenmp-simd: the `#pragma omp simd` loops, without linking an OpenMP runtime. Hidden
# visibility: only the functions of plimsoll_kernels.h are exported.
COMPILE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-pthread", "-fopenmp-simd", "-fvisibility=hidden")
# -z defs: an undefined symbol fails the build, not the first load.
LINK_FLAGS = ("-shared", "-pthread", "-Wl,-z,defs")
OPENMP_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-shared", "-Wl,-z,defs")

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # added to COMPILE_FLAGS
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags a CPU needs to run it
    capability: str  # torch.backends.cpu.get_cpu_capability() that implies them, where /proc is unreadable

    @property
    def library(self) -> str:
        return f"libplimsoll_cpu_{self.name}.so"


# Best first: the loader takes the first one the CPU runs.
X86_VARIANTS = (
    Variant("avx512", ("-march=x86-64-v4",), _V4, "AVX512"),
    Variant("avx2", ("-march=x86-64-v3",), _V3, "AVX2"),
    Variant("plain", ("-march=x86-64",), frozenset(), "DEFAULT"),
)
OTHER_VARIANTS = (Variant("plain", (), frozenset(), "DEFAULT"),)
VARIANT_NAMES = ("avx512", "avx2", "plain")


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64")


def variants_for(machine: str) -> tuple[Variant, ...]:
    """The variants built for (and runnable on) a machine of this ``platform.machine()``."""
    return X86_VARIANTS if is_x86(machine) else OTHER_VARIANTS


def build_hash(variant: Variant, csrc: Path = CSRC) -> str:
    """What a build of ``variant`` from the sources in ``csrc`` is compiled to carry: a hash of
    every source and header (names and contents) and of the flags."""
    digest = hashlib.sha256(" ".join((*COMPILE_FLAGS, *variant.flags)).encode() + b"\0")
    for path in sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
