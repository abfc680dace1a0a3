"""Configuration reaches the runtime through its config objects, read from the environment at the edge only.

Nothing under ``runtime/`` reads an environment variable (``os.environ``, ``os.getenv``, C's
``getenv``) except the command line's edge, ``runtime/cli.py`` and ``runtime/serve_args.py``,
which turn flags and the few variables a server honours into ``EngineConfig`` and server
settings. A switch that a test or a benchmark flips belongs in those config objects. Setting a
variable for a library that reads only its environment (``os.environ["X"] = ...``, inductor's
cache directory) is a write, not a read; neither is a worker removing the credentials it
inherited (``NOT_CONFIGURATION``).
"""

import re
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
EDGE = {"cli.py", "serve_args.py"}
# Uses that configure nothing: the chat-template worker drops inherited API keys before it renders.
NOT_CONFIGURATION = {("serving/template_worker.py", "drop_secrets(os.environ)")}
WRITE = re.compile(r"\bos\.environ\[[^\]]+\]\s*=(?!=)")
READS = re.compile(
    r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\s*\(|\bfrom\s+os\s+import\s+[^\n]*\b(environ|getenv)\b"
)


def test_nothing_in_the_runtime_reads_the_environment_outside_the_cli_edge() -> None:
    sources = [
        p for p in RUNTIME.rglob("*") if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts
    ]
    assert len(sources) > 50 and any(p.name == "pool.cpp" for p in sources)
    reads = []
    for path in sources:
        if path.relative_to(RUNTIME).as_posix() in EDGE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".py" else line.split("//", 1)[0]
            name = path.relative_to(RUNTIME).as_posix()
            if any(name == where and what in code for where, what in NOT_CONFIGURATION):
                continue
            if READS.search(WRITE.sub("", code)):
                reads.append(f"{path.relative_to(RUNTIME)}:{number}: {line.strip()}")
    assert reads == [], "environment read outside runtime/cli.py and runtime/serve_args.py:\n" + "\n".join(
        reads
    )
    # The edge itself does read it (the check above would pass vacuously on a pattern that matched nothing).
    assert READS.search((RUNTIME / "serve_args.py").read_text())
    assert READS.search(WRITE.sub("", 'os.environ["A"] == "1"')) and not READS.search(
        WRITE.sub("", 'os.environ["A"] = "1"')
    )
