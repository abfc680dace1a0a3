"""`plimsoll fetch hf://org/name[@revision] --local-dir DIR`: download a model before an engine starts.

(``python -m plimsoll.model_fetch`` runs the same command without the rest of the CLI.)

What it is: the init container of an LLMService replica whose ``model.uri`` is
``hf://`` (both engines). It resolves the revision to a commit, lists the files,
checks that they fit on the cache volume, and downloads them with huggingface_hub's
``snapshot_download`` (the hub client users already trust: resumable ``.incomplete``
files, etag checks, ``HF_ENDPOINT`` for mirrors, ``HF_TOKEN`` for gated repositories).
Progress goes to the log as plain lines; a failure exits with a code per cause and
writes a one-line reason to the container's termination message, which the operator
turns into a condition (``operator/resources/model_fetch.py`` maps the codes back):

======  ====================  ==================================================
 code    reason                 what the user does
======  ====================  ==================================================
 3       RepositoryNotFound     fix ``model.uri`` (or the token: private repos 404)
 4       AccessDenied           accept the licence / set ``model.tokenSecretRef``
 5       RevisionNotFound       fix the ``@revision``
 6       DiskFull               a larger ``model.cache.sizeLimit`` or claim
 7       DownloadFailed         hub or network trouble, retried with back-off
======  ====================  ==================================================

Transient failures (connection errors, 5xx, 429) are retried here with exponential
back-off before the process gives up; after that the kubelet's restart back-off
takes over, so nothing loops hot. A directory already fetched at the same commit is
reused without downloading (a PVC or node-local hostPath cache survives restarts), once
every file's content matches the hub's hash (LFS SHA-256 for weights, the git blob id for
small files); a file that does not is downloaded again (only that file), and a download
that does not match fails. The marker file records, per file, the digest it was checked
against and the file's stat then, so a warm start re-hashes only files changed since
(``--rehash`` hashes all). One fetch at a time writes a directory (a lock beside it):
pods starting together on one node share the download.

What it is not: a loader (the engines read the directory) or a general hub client;
nothing here runs in the engine process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

log = logging.getLogger("plimsoll.fetch")

FETCH_EXIT_CODES = {
    "RepositoryNotFound": 3,
    "AccessDenied": 4,
    "RevisionNotFound": 5,
    "DiskFull": 6,
    "DownloadFailed": 7,
}
MARKER = ".plimsoll-fetch.json"
# Other weight formats a repository often carries beside safetensors; the engines read safetensors.
_DUPLICATE_WEIGHTS = (
    ".bin",
    ".pt",
    ".pth",
    ".h5",
    ".msgpack",
    ".ot",
    ".onnx",
    ".onnx_data",
    ".gguf",
    ".tflite",
)


class FetchError(Exception):
    """A download that cannot succeed as asked; ``reason`` is a key of FETCH_EXIT_CODES."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HubRef:
    """``hf://org/name@revision`` parsed."""

    repo_id: str
    revision: str

    @classmethod
    def parse(cls, uri: str) -> HubRef:
        rest = uri.removeprefix("hf://")
        repo, _, revision = rest.partition("@")
        parts = repo.split("/")
        if not uri.startswith("hf://") or len(parts) != 2 or not all(parts):
            raise ValueError(f"{uri!r} is not hf://<org>/<name>[@revision]")
        return cls(repo, revision or "main")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def select_files(sizes: dict[str, int]) -> list[str]:
    """The files to download: everything, minus other weight formats when safetensors exist."""
    names = sorted(sizes)
    if not any(n.endswith(".safetensors") for n in names):
        return names
    return [n for n in names if not n.endswith(_DUPLICATE_WEIGHTS)]


def _classify(error: BaseException) -> tuple[str, bool]:
    """(reason, transient) for an exception from huggingface_hub or the filesystem."""
    from huggingface_hub import errors

    if isinstance(error, errors.RevisionNotFoundError):
        return "RevisionNotFound", False
    if isinstance(error, errors.GatedRepoError | errors.DisabledRepoError):
        return "AccessDenied", False
    if isinstance(error, errors.RepositoryNotFoundError):
        # The hub answers 401/404 alike for "missing" and "private without a token".
        return "RepositoryNotFound", False
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "DiskFull", False
    if isinstance(error, errors.HfHubHTTPError):
        status = error.response.status_code if error.response is not None else 0
        if status in (401, 403):
            return "AccessDenied", False
        return "DownloadFailed", status >= 500 or status in (408, 429)
    return "DownloadFailed", True


def _explain(reason: str, ref: HubRef, error: BaseException) -> str:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    token = "a token (HF_TOKEN)" if os.environ.get("HF_TOKEN") else "no token"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    hints = {
        "RepositoryNotFound": f"repository {ref.repo_id} not found at {endpoint} with {token}; check "
        "model.uri, or set model.tokenSecretRef if it is private",
        "AccessDenied": f"no access to {ref.repo_id} with {token}: accept its licence on the hub and set "
        "model.tokenSecretRef to a Secret holding a token that has read access",
        "RevisionNotFound": f"revision {ref.revision!r} does not exist in {ref.repo_id}; fix the @revision "
        "in model.uri (a branch, tag or commit)",
        "DiskFull": f"the cache volume is full: {first}; raise model.cache.sizeLimit or use a larger "
        "model.cache.claimName",
    }
    return hints.get(reason, f"download of {ref.repo_id}@{ref.revision} failed: {first}")


def _log_progress_class(every_seconds: float) -> Any:
    """A tqdm class that writes a plain log line every ``every_seconds`` and when done.

    A pod log is not a terminal: a redrawn bar would be thousands of lines. Only the
    byte-counting bar is logged; huggingface_hub grows its total as files start, so
    the line says bytes so far, not a percentage that would jump backwards.
    """
    from tqdm.auto import tqdm

    class LogProgress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # huggingface_hub's byte bar for the whole snapshot; per-file bars stay silent.
            self._logged = kwargs.get("desc") == "Downloading bytes"
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed with the bar
            kwargs["disable"] = False
            self._last_log = time.monotonic()
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown: bool | None = super().update(n)
            if self._logged and time.monotonic() - self._last_log >= every_seconds:
                self._last_log = time.monotonic()
                log.info("downloaded %s of %s so far", _size(self.n), _size(self.total or 0))
            return shown

        def close(self) -> None:
            if self._logged and not self.disable:
                log.info("downloaded %s", _size(self.n))
            super().close()
            if self.fp is not None and not self.fp.closed:
                self.fp.close()

    return LogProgress


def _read_marker(local_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((local_dir / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Expected:
    """What the hub says one file is: its size, its LFS SHA-256 (weights) and its git blob id."""

    size: int
    sha256: str | None
    blob_id: str

    @classmethod
    def of(cls, entry: Any) -> Expected:
        lfs = getattr(entry, "lfs", None)
        return cls(
            int(entry.size), getattr(lfs, "sha256", None) if lfs is not None else None, str(entry.blob_id)
        )


def matches(path: Path, expected: Expected) -> bool:
    """Whether the file on disk is the hub's, by content hash, not size alone: a cache volume
    written by someone else (or a torn download) must not be served as the model."""
    if not path.is_file() or path.stat().st_size != expected.size:
        return False
    with path.open("rb") as f:
        if expected.sha256 is not None:
            return hashlib.file_digest(f, "sha256").hexdigest() == expected.sha256
        blob = hashlib.sha1(b"blob %d\0" % expected.size)  # git's object id of a blob
        for chunk in iter(lambda: f.read(1 << 20), b""):
            blob.update(chunk)
    return blob.hexdigest() == expected.blob_id


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _digest(expected: Expected) -> str:
    return f"sha256:{expected.sha256}" if expected.sha256 is not None else f"blob:{expected.blob_id}"


def _verified_unchanged(local_dir: Path, name: str, expected: Expected, marker: dict[str, Any]) -> bool:
    """Whether the marker recorded ``name`` as hashed to ``expected`` and the file has not changed since.

    The stored digest spares a warm start re-reading every weight (a second or more per GiB):
    git's index rule. The file's size, mtime, ctime and inode must equal what was recorded
    when its hash was checked, and that check must predate the marker by more than the
    filesystem's timestamp tick; otherwise a rewrite in the same tick ("racily clean") could
    pass, so such a file is hashed again. ctime cannot be set back from user space, so a
    rewrite that restores the mtime is still seen.
    """
    record = (marker.get("verified") or {}).get(name)
    if not isinstance(record, dict) or record.get("digest") != _digest(expected):
        return False
    try:
        now = _stat_key(local_dir / name)
        marker_mtime = (local_dir / MARKER).stat().st_mtime_ns
    except OSError:
        return False
    return bool(record.get("stat") == now and now[2] < marker_mtime)


def _write_marker(
    local_dir: Path, ref: HubRef, commit: str, files: list[str], expected: dict[str, Expected]
) -> None:
    """Record the snapshot and, per file, the digest it was checked against and its stat at that time."""
    verified = {f: {"digest": _digest(expected[f]), "stat": _stat_key(local_dir / f)} for f in files}
    body = {
        "repo": ref.repo_id,
        "revision": ref.revision,
        "commit": commit,
        "files": files,
        "verified": verified,
    }
    tmp = local_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(body))
    # A reader never sees half a marker; and written after every file, its mtime dates the checks.
    tmp.replace(local_dir / MARKER)


@contextlib.contextmanager
def _exclusive(local_dir: Path) -> Iterator[None]:
    """Hold the directory's lock: on a node-local cache several pods (and the fill DaemonSet's pod)
    may fetch the same snapshot at once; the second waits, then finds it complete."""
    local_dir.mkdir(parents=True, exist_ok=True)
    lock_path = local_dir.parent / f".{local_dir.name}.lock"
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another fetch is writing %s; waiting for it", local_dir)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_bytes(local_dir: Path) -> int:
    probe = local_dir
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def fetch(
    ref: HubRef,
    local_dir: Path,
    *,
    attempts: int = 4,
    backoff_seconds: float = 2.0,
    progress_seconds: float = 10.0,
    rehash: bool = False,
) -> str:
    """Download ``ref`` into ``local_dir``; return the commit. Raises FetchError.

    Files the marker records as checked and unchanged since are not hashed again unless
    ``rehash``; every other file present is hashed, and one that differs is downloaded again.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    # HF_ENDPOINT and HF_TOKEN, as every hub client reads them; read here rather than at
    # huggingface_hub's import so the values of this call are the ones used.
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    api_args: dict[str, Any] = {"endpoint": endpoint, "token": token}
    api = HfApi(**api_args)
    delay = backoff_seconds
    for attempt in range(1, attempts + 1):
        try:
            info = api.repo_info(ref.repo_id, revision=ref.revision)
            commit = str(info.sha)
            tree = api.list_repo_tree(ref.repo_id, revision=commit, recursive=True)
            expected = {f.path: Expected.of(f) for f in tree if isinstance(f, RepoFile)}
            sizes = {path: e.size for path, e in expected.items()}
            files = select_files(sizes)
            total = sum(sizes[f] for f in files)
            log.info(
                "%s@%s is commit %s: %d files, %s (skipped %d other-format weight files)",
                ref.repo_id, ref.revision, commit[:12], len(files), _size(total), len(sizes) - len(files),
            )  # fmt: skip
            with _exclusive(local_dir):
                return _fill(api_args, ref, commit, local_dir, files, expected, progress_seconds, rehash)
        except FetchError:
            raise
        except Exception as error:
            reason, transient = _classify(error)
            message = _explain(reason, ref, error)
            if not transient or attempt == attempts:
                raise FetchError(reason, message) from error
            log.warning("attempt %d/%d: %s; retrying in %.0f s", attempt, attempts, message, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _fill(
    api_args: dict[str, Any],
    ref: HubRef,
    commit: str,
    local_dir: Path,
    files: list[str],
    expected: dict[str, Expected],
    progress_seconds: float,
    rehash: bool,
) -> str:
    """Bring ``local_dir`` to ``files`` at ``commit``: skip what is there and verified, repair the rest."""
    from huggingface_hub import snapshot_download

    sizes = {path: e.size for path, e in expected.items()}
    total = sum(sizes[f] for f in files)
    marker = _read_marker(local_dir)
    same_snapshot = marker.get("commit") == commit

    def present(f: str) -> bool:
        if not rehash and same_snapshot and _verified_unchanged(local_dir, f, expected[f], marker):
            return True
        return matches(local_dir / f, expected[f])

    good = [f for f in files if present(f)]
    if len(good) == len(files) and same_snapshot and sorted(marker.get("files", [])) == files:
        log.info("already in %s at commit %s (hashes checked); nothing to download", local_dir, commit[:12])
        return commit
    for f in files:
        if f not in good and (local_dir / f).exists():
            # Not the hub's bytes: removed, so the download below writes the real file.
            log.warning("%s in the cache does not match the hub's hash; downloading it again", f)
            (local_dir / f).unlink()
    missing = [f for f in files if f not in good]
    if good:
        log.info(
            "%d of %d files already present and verified; downloading %d", len(good), len(files), len(missing)
        )
    need = sum(sizes[f] for f in missing)
    free = _free_bytes(local_dir)
    if need > free:
        raise FetchError(
            "DiskFull",
            f"{ref.repo_id} needs {_size(need)} more but the cache volume has {_size(free)} free; "
            "raise model.cache.sizeLimit or use a larger model.cache.claimName or hostPath volume",
        )
    started = time.monotonic()
    if missing:
        snapshot_download(
            ref.repo_id,
            revision=commit,
            local_dir=str(local_dir),
            allow_patterns=missing,
            tqdm_class=_log_progress_class(progress_seconds),
            max_workers=4,
            **api_args,
        )
    wrong = [f for f in missing if not matches(local_dir / f, expected[f])]
    if wrong:
        raise FetchError(
            "DownloadFailed",
            f"{ref.repo_id}@{commit[:12]}: {', '.join(wrong[:5])} do not match the hub's hashes after "
            "download (a proxy or mirror altered them?)",
        )
    _write_marker(local_dir, ref, commit, files, expected)
    log.info(
        "fetched %s (%s) into %s in %.1f s", ref.repo_id, _size(total), local_dir, time.monotonic() - started
    )
    return commit


def _write_termination_message(text: str) -> None:
    path = Path(os.environ.get("PLIMSOLL_TERMINATION_LOG", "/dev/termination-log"))
    # Outside Kubernetes there is no termination log; the log line says it all.
    with contextlib.suppress(OSError):
        path.write_text(text + "\n")


def fetch_command(
    uri: str = typer.Argument(
        ..., help="hf://<org>/<name>[@revision] (revision: branch, tag or commit; default main)."
    ),
    local_dir: Path = typer.Option(
        ..., "--local-dir", help="Directory the files are written to (the cache volume)."
    ),
    attempts: int = typer.Option(
        4, "--attempts", min=1, help="Tries for transient failures (network, 5xx, 429)."
    ),
    backoff: float = typer.Option(
        2.0, "--backoff", min=0, help="Seconds before the first retry; doubles each time."
    ),
    rehash: bool = typer.Option(
        False, "--rehash", help="Hash every file present again, even those recorded as checked and unchanged."
    ),
    make_dirs: list[Path] = typer.Option(
        [],
        "--make-dir",
        help="Also create this directory (mode 0700, as this user) on the volume: the engine's compilation "
        "cache beside a node-local model cache. Repeatable.",
    ),
) -> None:
    """Download a Hugging Face model before an engine starts (the LLMService init container)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # One line per HTTP request is noise in a pod log; failures are logged by this module.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        ref = HubRef.parse(uri)
    except ValueError as error:
        typer.echo(f"plimsoll fetch: {error}", err=True)
        raise typer.Exit(code=2) from None
    try:
        local_dir.mkdir(parents=True, exist_ok=True)
        # Before the download, as this user: a directory a later container mounts by subPath would
        # otherwise be created by the kubelet as root and be unwritable to the engine.
        for directory in make_dirs:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fetch(ref, local_dir, attempts=attempts, backoff_seconds=backoff, rehash=rehash)
    except FetchError as error:
        line = f"{error.reason}: {error}"
        log.error("%s", line)
        _write_termination_message(line)
        raise typer.Exit(code=FETCH_EXIT_CODES[error.reason]) from None
    except OSError as error:
        reason = "DiskFull" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "DownloadFailed"
        line = f"{reason}: cannot write {local_dir}: {error}"
        log.error("%s", line)
        _write_termination_message(line)
        raise typer.Exit(code=FETCH_EXIT_CODES[reason]) from None


def main() -> None:
    """``python -m plimsoll.model_fetch URI --local-dir DIR``: the init container's entry point.

    The same command as ``plimsoll fetch`` without loading the whole CLI (every subcommand's
    imports): on a warm node cache the fetch is a hash-checked no-op, so its start-up is the
    step's cost.
    """
    typer.run(fetch_command)


if __name__ == "__main__":
    main()
