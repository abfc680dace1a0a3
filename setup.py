"""Build step: the CPU kernels (runtime/kernels/csrc) compiled once per instruction set at install.

`pip install .` and `pip install -e .` run it (the image runs it in its build stage): every
variant named in runtime/kernels/cpu_variants.py is compiled with the C++ compiler ($CXX, else
c++ or g++), its translation units in parallel, into
plimsoll/runtime/kernels/libplimsoll_cpu_<variant>.so, and libplimsoll_openmp.so beside them.
At run time cpu_library.py loads the variant the CPU runs; a serving process needs no compiler.
Without a compiler, or when a build fails, the install still succeeds with a warning, and the
runtime serves through torch alone and says why in its start-up line.

Everything else about the distribution is in pyproject.toml.
"""

import importlib.util
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "cpu_variants", ROOT / "runtime" / "kernels" / "cpu_variants.py"
)
assert _spec is not None and _spec.loader is not None
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)

PACKAGE = "plimsoll.runtime.kernels"
CSRC = ROOT / "runtime" / "kernels" / "csrc"


def _stem(filename: str) -> str:
    return filename.removesuffix(".so")


class BuildCPUKernels(build_ext):
    """Builds the kernel libraries (plain shared objects loaded with ctypes, not Python modules)."""

    def get_ext_filename(self, fullname: str) -> str:
        # Called with a bare name (distutils) or a dotted one (setuptools' in-place mapping).
        parts = fullname.split(".")
        return os.path.join(*parts[:-1], parts[-1] + ".so")

    def build_extensions(self) -> None:
        self.compiler_cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        if self.compiler_cxx is None:
            self.warn(f"no C++ compiler (set CXX or install g++): {target.name} not built; the CPU kernels "
                      "will be unavailable and the runtime will use torch's ops alone")  # fmt: skip
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            if ext.name.endswith(_stem(variants.OPENMP_LIBRARY)):  # one small file: always rebuilt
                self._run([self.compiler_cxx, *variants.OPENMP_FLAGS, str(CSRC / variants.OPENMP_SOURCE),
                           "-o", str(target)])  # fmt: skip
            else:
                self._build_variant(ext, target)
        except (OSError, subprocess.CalledProcessError) as exc:
            target.unlink(missing_ok=True)
            detail = getattr(exc, "stderr", "") or ""
            self.warn(f"{target.name} not built ({exc}); the runtime will not use that build\n{detail}")

    def _build_variant(self, ext: Extension, target: Path) -> None:
        name = ext.name.rsplit("_", 1)[-1]
        variant = next(v for v in variants.variants_for(platform.machine()) if v.name == name)
        digest = variants.build_hash(variant, CSRC)
        # A library that carries this digest was built from these very sources and flags: kept, or
        # (an editable install's, beside the sources) copied, instead of compiled again.
        build_py = self.get_finalized_command("build_py")
        in_place = Path(build_py.get_package_dir(PACKAGE)) / target.name
        for built in (target, in_place):
            if not self.force and built.is_file() and digest.encode() in built.read_bytes():
                if built != target:
                    shutil.copyfile(built, target)
                return
        objects = Path(self.build_temp) / "cpu_kernels" / name
        objects.mkdir(parents=True, exist_ok=True)
        defines = [f'-DPLIMSOLL_BUILD_HASH="{digest}"', f'-DPLIMSOLL_VARIANT="{name}"']
        compile_flags = [*variants.COMPILE_FLAGS, *variant.flags, *defines]
        jobs = [
            [
                self.compiler_cxx,
                *compile_flags,
                "-c",
                str(CSRC / source),
                "-o",
                str(objects / (source + ".o")),
            ]
            for source in variants.SOURCES
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(self._run, jobs))
        self._run([self.compiler_cxx, *variant.flags, *variants.LINK_FLAGS,
                   *(str(objects / (s + ".o")) for s in variants.SOURCES), "-o", str(target)])  # fmt: skip

    def _run(self, cmd: list[str]) -> None:
        self.announce(" ".join(cmd), level=2)
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, cmd[:1], stderr=result.stderr[-2000:])


def _extensions() -> list[Extension]:
    names = [_stem(v.library) for v in variants.variants_for(platform.machine())]
    names.append(_stem(variants.OPENMP_LIBRARY))
    # The sources are compiled by BuildCPUKernels; listing them marks the extensions' inputs.
    sources = [str(Path("runtime", "kernels", "csrc", s)) for s in variants.SOURCES]
    return [Extension(f"{PACKAGE}.{name}", sources=sources, optional=True) for name in names]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildCPUKernels})
