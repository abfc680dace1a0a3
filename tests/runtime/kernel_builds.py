"""What the kernel tests need to know about this install's CPU kernel builds.

``needs_kernels`` skips a test module where plimsoll was installed without any build of the
kernels (no C++ compiler at install: the runtime then runs torch's ops alone, tested elsewhere);
where a build is installed, a kernel that fails to load fails the tests instead of hiding.
"""

import platform

import pytest

from plimsoll.runtime.kernels import cpu_library, cpu_variants

INSTALLED = [
    v.name for v in cpu_variants.variants_for(platform.machine()) if (cpu_library.PACKAGE_DIR / v.library).is_file()
]
RUNNABLE = [v.name for v in cpu_library.best_variants() if v.name in INSTALLED]

needs_kernels = pytest.mark.skipif(
    not INSTALLED, reason="no CPU kernel build installed (plimsoll was installed without a C++ compiler)"
)
