"""Compiling Triton kernels for an H200 (sm_90) without a GPU, for the runtime's kernel tests.

The interpreter accepts code the compiler rejects, so each Triton test module also compiles its
kernels for real, in a clean process (no TRITON_INTERPRET), and checks that ptxas spilled no
registers. ``run_sm90(script)`` runs ``script`` after :data:`PRELUDE`, which defines
``compile_sm90(fn, signature, constexprs, num_warps)`` returning ptxas's register and stack use
("REG:n STACK:n", or "?" where Triton's package carries no cuobjdump), and returns the
non-empty lines the script printed.
"""

import os
import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent(
    """
    import inspect, os, subprocess, tempfile, warnings
    warnings.simplefilter("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def compile_sm90(fn, signature, constexprs, num_warps):
        c = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        if not os.path.exists(_CUOBJDUMP):
            return "?"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"]); f.flush()
            out = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        return " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()[:2])
    """
)


def run_sm90(script: str, timeout: float = 500) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.split("\n") if line.strip()]


def assert_no_spills(lines: list[str]) -> None:
    for line in lines:
        # "STACK:0" absent means ptxas spilled registers to local memory (slow)
        assert "STACK:0" in line or "?" in line, f"register spills: {line}"
