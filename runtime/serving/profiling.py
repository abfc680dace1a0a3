"""``POST /debug/profile``: a profile of this replica on demand, bounded and one at a time.

What it is: :func:`add_profile_route`, which puts the route on the app. With
``--enable-profiling`` it takes ``seconds`` (1–300) and ``kind``: ``torch`` (a
torch.profiler trace of the engine loop as Chrome trace JSON, one
``engine_step`` span per step; open it in Perfetto or chrome://tracing) or
``py-spy`` (a flame graph SVG of the whole process, sampled by ``py-spy record``
in a child process, where py-spy is installed). Each result is also written to
the profile directory (the last few are kept), whose path the response names in
``X-Plimsoll-Profile-Path``, so a caller that cannot hold the body can fetch it
from the pod's volume. Without the flag the route answers 404 saying how to turn
it on. The wait is ``asyncio.sleep`` and the export runs in a worker thread, so
other requests are served throughout.
What it is not: the recorder (``engine/step_profiler.py``) or the API-key check
(``auth.py``: ``/debug/*`` needs the admin key).
"""

from __future__ import annotations

import asyncio
import ctypes
import gzip
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from plimsoll.runtime.serving.errors import APIError

log = logging.getLogger("plimsoll.runtime.serving.profiling")

MIN_SECONDS = 1.0
MAX_SECONDS = 300.0
KINDS = ("torch", "py-spy")
KEEP_FILES = 5
# Engine-thread commands answer within a step; a wedged engine must not hold the request forever.
ENGINE_ANSWER_S = 60.0


def default_profile_dir() -> Path:
    """A fresh directory of this process (mode 0700, unpredictable name): never a fixed /tmp path another
    local user could have created or pointed elsewhere first."""
    return Path(tempfile.mkdtemp(prefix="plimsoll-profiles-"))


def py_spy_binary() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


PR_SET_PTRACER = 0x59616D61


def set_ptracer(pid: int) -> None:
    """Let exactly ``pid`` (and its children) trace this process where Yama allows only tracing
    descendants: ``prctl(PR_SET_PTRACER, pid)``; 0 takes the permission back. A no-op off Linux
    or without Yama. Never ``PR_SET_PTRACER_ANY``: that would let any process of this user read
    the server's memory (its keys, every prompt) for as long as it runs."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("prctl(PR_SET_PTRACER) unavailable; py-spy needs ptrace permission instead")


def checked_profile_dir(folder: Path) -> Path:
    """``folder``, created 0700 if missing; refused (APIError 500) when it is a symlink, not ours,
    or open to others, so a profile never lands where another user chose."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise APIError(500, f"the profile directory {folder} is not a plain directory; use --profile-dir")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise APIError(
            500,
            f"the profile directory {folder} belongs to another user or is writable by others; "
            "use a directory of the server's own (--profile-dir)",
        )
    return folder


def parse_profile_query(query: Any) -> tuple[float, str]:
    """``seconds`` and ``kind`` from the query string; APIError 400 saying what to send."""
    raw = query.get("seconds")
    if raw is None:
        raise APIError(
            400, "seconds is required, e.g. POST /debug/profile?seconds=20&kind=torch", param="seconds"
        )
    try:
        seconds = float(str(raw).removesuffix("s"))
    except ValueError:
        raise APIError(
            400, f"seconds={raw!r} is not a number; send e.g. seconds=20", param="seconds"
        ) from None
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise APIError(
            400,
            f"seconds={raw} is out of range; profile between {MIN_SECONDS:g} and {MAX_SECONDS:g} seconds",
            param="seconds",
        )
    kind = str(query.get("kind", "torch"))
    if kind not in KINDS:
        raise APIError(400, f"kind={kind!r} is not a profile kind; use torch or py-spy", param="kind")
    return seconds, kind


class ProfileStore:
    """The profile directory: every result written there, the oldest beyond ``KEEP_FILES`` removed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def save(self, kind: str, suffix: str, data: bytes) -> Path:
        checked_profile_dir(self.folder)
        path = self.folder / f"profile-{time.strftime('%Y%m%dT%H%M%S')}-{kind}{suffix}"
        path.write_bytes(data)
        old = sorted(self.folder.glob("profile-*"), key=lambda p: p.stat().st_mtime)[:-KEEP_FILES]
        for stale in old:
            stale.unlink(missing_ok=True)
        return path


async def _torch_trace(engine: Any, seconds: float, scratch: Path) -> bytes:
    """Chrome trace JSON of the engine loop over ``seconds``."""
    from plimsoll.runtime.engine.step_profiler import ProfileBusyError

    try:
        await asyncio.wait_for(engine.begin_profile(), ENGINE_ANSWER_S)
    except ProfileBusyError as exc:
        raise APIError(409, f"{exc}; wait for it to finish") from None
    try:
        await asyncio.sleep(seconds)
    finally:
        profile = await asyncio.wait_for(engine.end_profile(), ENGINE_ANSWER_S)
    path = scratch / "trace.json"
    await asyncio.to_thread(profile.export_chrome_trace, str(path))
    return await asyncio.to_thread(path.read_bytes)


async def _py_spy_flamegraph(seconds: float, scratch: Path) -> bytes:
    """A py-spy flame graph SVG of this process over ``seconds`` (the process is not paused)."""
    binary = py_spy_binary()
    if binary is None:
        raise APIError(
            501,
            "py-spy is not installed in this replica; `pip install py-spy` in the image, or use kind=torch",
            param="kind",
        )
    out = scratch / "flame.svg"
    # --idle: sample waiting threads too; an idle server's stacks (where the engine loop and the
    # event loop wait) are an answer, where without it py-spy finds "no stack counts" and fails.
    cmd = [binary, "record", "--nonblocking", "--idle", "--duration", str(max(1, round(seconds))), "--pid",
           str(os.getpid()), "--format", "flamegraph", "--output", str(out)]  # fmt: skip
    # A shell that waits for one line, then becomes py-spy (same pid): the pid is known, and allowed
    # to trace this process, before py-spy attaches.
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", 'read _ && exec "$0" "$@"', *cmd,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    set_ptracer(proc.pid)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(b"go\n"), seconds + ENGINE_ANSWER_S)
    except (TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    finally:
        set_ptracer(0)
    if proc.returncode != 0 or not out.exists():
        tail = output.decode(errors="replace").strip()[-400:]
        raise APIError(
            500,
            f"py-spy exited with code {proc.returncode}: {tail} (it needs ptrace permission on this "
            "process, e.g. the SYS_PTRACE capability in a container); kind=torch needs none",
        )
    return out.read_bytes()


def add_profile_route(app: FastAPI, engine: Any, enabled: bool, profile_dir: Path | None = None) -> None:
    """Put ``POST /debug/profile`` on ``app`` (off: a 404 that says how to turn it on)."""
    store = ProfileStore(profile_dir or default_profile_dir()) if enabled else None
    busy = asyncio.Lock()

    @app.post("/debug/profile")
    async def debug_profile(request: Request) -> Response:
        if not enabled:
            raise APIError(404, "Profiling is off on this server; start it with --enable-profiling.")
        assert store is not None, "built when profiling is on"
        seconds, kind = parse_profile_query(request.query_params)
        if not engine.is_ready:
            raise APIError(503, "The model is still loading; profile once /ready answers 200.")
        if busy.locked():
            raise APIError(409, "A profile is already being taken on this server; wait for it to finish.")
        async with busy:
            log.info("profiling for %gs (%s)", seconds, kind)
            with tempfile.TemporaryDirectory(prefix="plimsoll-profile-") as scratch:
                if kind == "torch":
                    data = await _torch_trace(engine, seconds, Path(scratch))
                    media, suffix = "application/json", ".json.gz"
                    stored = await asyncio.to_thread(gzip.compress, data, 6)
                else:
                    data = await _py_spy_flamegraph(seconds, Path(scratch))
                    media, suffix = "image/svg+xml", ".svg"
                    stored = data
            path = await asyncio.to_thread(store.save, kind, suffix, stored)
        log.info("profile written to %s (%d bytes)", path, len(stored))
        headers = {"X-Plimsoll-Profile-Path": str(path), "X-Plimsoll-Profile-Kind": kind}
        return Response(data, media_type=media, headers=headers)
