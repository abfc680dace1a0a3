"""`plimsoll profile --url URL --seconds S -o DIR`: take a profile of a running replica.

What it is: :func:`take_profile`, one ``POST /debug/profile?seconds=S&kind=K`` to
a `plimsoll serve` started with ``--enable-profiling``, read back as a
:class:`Profile` (the bytes, their kind, where the server also stored them);
the CLI command around it shows a countdown while the server records, writes the
file to ``DIR`` and says how to open it. The operator's annotation flow
(``operator/handlers/runtime_profile.py``) calls the same function, so both agree
on the protocol and its errors.
What it is not: the endpoint (``runtime/serving/profiling.py``) or a viewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import typer

from plimsoll.auth import ADMIN_API_KEY_ENV

KINDS = ("torch", "py-spy")
SUFFIX = {"torch": ".json", "py-spy": ".svg"}
# Beyond the profile itself: the export of a large trace and the transfer.
EXPORT_ALLOWANCE_S = 120.0
# A 300 s torch trace of a busy engine is tens of MiB; far above that is not a profile.
MAX_PROFILE_BYTES = 256 * 1024 * 1024


class ProfileError(RuntimeError):
    """The server did not return a profile; the message is the server's reason or the transport's."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Profile:
    """A profile as returned by the server."""

    kind: str
    data: bytes
    server_path: str | None  # where the replica also stored it (gzip for torch traces)

    @property
    def filename(self) -> str:
        return f"profile-{time.strftime('%Y%m%dT%H%M%S')}-{self.kind}{SUFFIX[self.kind]}"


def _reason(status: int, body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace") or f"HTTP {status}"


async def take_profile(
    url: str,
    seconds: float,
    kind: str = "torch",
    admin_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    max_bytes: int = MAX_PROFILE_BYTES,
) -> Profile:
    """Ask the replica at ``url`` for a ``kind`` profile of ``seconds``; ProfileError when it says no.

    ``/debug/profile`` is a control endpoint: ``admin_key`` is the replica's ``--admin-api-key``.
    The answer is read as it streams in and refused past ``max_bytes``, so a replica cannot make
    the caller (the operator, shared by every LLMService) hold an unbounded body.
    """
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    timeout = httpx.Timeout(seconds + EXPORT_ALLOWANCE_S, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
        try:
            async with client.stream(
                "POST", f"{url.rstrip('/')}/debug/profile", params={"seconds": f"{seconds:g}", "kind": kind},
                headers=headers,
            ) as response:  # fmt: skip
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise ProfileError(
                            f"{url} sent a profile larger than {max_bytes} bytes; take a shorter one"
                        )
        except httpx.HTTPError as error:
            raise ProfileError(f"could not reach {url}: {error!r}") from error
    if response.status_code != 200:
        raise ProfileError(
            f"{url} answered {response.status_code}: {_reason(response.status_code, bytes(body))}",
            response.status_code,
        )
    return Profile(kind=kind, data=bytes(body), server_path=response.headers.get("x-plimsoll-profile-path"))


def _countdown(seconds: float, done: asyncio.Event, show: Callable[[str], None]) -> asyncio.Task[None]:
    async def tick() -> None:
        start = time.monotonic()
        while not done.is_set():
            elapsed = time.monotonic() - start
            phase = "recording" if elapsed < seconds else "exporting and downloading"
            show(f"{phase}: {min(elapsed, seconds):.0f}/{seconds:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)

    return asyncio.create_task(tick())


def profile_command(
    url: str = typer.Option(..., "--url", help="The replica, e.g. http://127.0.0.1:8000."),
    seconds: float = typer.Option(20.0, "--seconds", min=1, max=300, help="How long to record (1-300)."),
    out_dir: Path = typer.Option(
        Path("."), "-o", "--output-dir", help="Directory the profile is written to."
    ),
    kind: str = typer.Option(
        "torch", "--kind", help="torch (Chrome trace of the engine loop) or py-spy (flame graph SVG)."
    ),
    admin_key: str | None = typer.Option(
        None, "--admin-api-key", envvar=ADMIN_API_KEY_ENV,
        help="The server's --admin-api-key (/debug/profile is a control endpoint); not needed on the "
        "server's own machine when it has none.",
    ),
) -> None:
    """Take a profile of a running `plimsoll serve --enable-profiling` and save it."""
    if kind not in KINDS:
        typer.echo(f"plimsoll profile: --kind {kind!r} is not a profile kind; use torch or py-spy", err=True)
        raise typer.Exit(code=2)
    live = sys.stderr.isatty()
    typer.echo(f"profiling {url} for {seconds:g} s ({kind}) ...", err=True)

    def show(line: str) -> None:
        if live:
            sys.stderr.write(f"\r{line}   ")
            sys.stderr.flush()

    async def run() -> Profile:
        done = asyncio.Event()
        ticker = _countdown(seconds, done, show)
        try:
            return await take_profile(url, seconds, kind, admin_key)
        finally:
            done.set()
            await ticker

    try:
        profile = asyncio.run(run())
    except ProfileError as error:
        if live:
            sys.stderr.write("\n")
        typer.echo(f"plimsoll profile: {error}", err=True)
        raise typer.Exit(code=1) from None
    if live:
        sys.stderr.write("\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / profile.filename
    path.write_bytes(profile.data)
    how = (
        "open it in https://ui.perfetto.dev or chrome://tracing (spans named engine_step are engine steps)"
        if kind == "torch"
        else "open it in a browser (a flame graph of every thread)"
    )
    typer.echo(f"wrote {path} ({len(profile.data)} bytes); {how}")
    if profile.server_path:
        typer.echo(f"the replica also keeps it at {profile.server_path}")
