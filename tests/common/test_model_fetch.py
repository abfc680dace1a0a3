"""`plimsoll fetch`: the real huggingface_hub download code against a local stand-in for the hub.

No hub is reachable from test machines, so ``plimsoll.devcluster.hubmirror.HubMirror``
stands in for huggingface.co: an HTTP server on 127.0.0.1 that serves model folders
in the hub's REST layout (revision info, tree listing, /resolve/ with etags and LFS
headers, X-Error-Code errors). The client under test finds it through ``HF_ENDPOINT``,
exactly as a user's mirror would be found; nothing in the fetch code knows it is a test.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plimsoll.devcluster.hubmirror import HubMirror, HubRepo
from plimsoll.model_fetch import FETCH_EXIT_CODES, FetchError, HubRef, fetch, select_files
from plimsoll.operator.resources.model_fetch import FETCH_REASONS


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "sub" / "tokenizer.json").write_text("{}")
    (root / "model.safetensors").write_bytes(os.urandom(200_000))
    (root / "pytorch_model.bin").write_bytes(os.urandom(5_000))  # a duplicate format, skipped
    return root


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, repo_dir: Path) -> HubMirror:
    mirror = HubMirror(
        {
            "org/model": HubRepo({"main": repo_dir}),
            "org/gated": HubRepo({"main": repo_dir}, gated=True, tokens=frozenset({"hf_good"})),
        }
    ).start()
    monkeypatch.setenv("HF_ENDPOINT", mirror.endpoint)
    monkeypatch.setenv("HF_HOME", str(repo_dir.parent / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield mirror
    mirror.stop()


def test_hub_ref_parses_revision() -> None:
    assert HubRef.parse("hf://org/name") == HubRef("org/name", "main")
    assert HubRef.parse("hf://org/name@refs/pr/1") == HubRef("org/name", "refs/pr/1")
    with pytest.raises(ValueError, match="hf://<org>/<name>"):
        HubRef.parse("hf://only-org")


def test_select_files_skips_duplicate_weight_formats() -> None:
    assert select_files({"a.safetensors": 1, "b.bin": 1, "c.json": 1}) == ["a.safetensors", "c.json"]
    assert select_files({"m.gguf": 1, "c.json": 1}) == ["c.json", "m.gguf"]


def test_exit_codes_match_the_operator_table() -> None:
    assert {code: reason for reason, code in FETCH_EXIT_CODES.items()} == FETCH_REASONS


def test_downloads_snapshot_then_reuses_it(hub: HubMirror, repo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache" / "org" / "model" / "main"
    commit = fetch(HubRef("org/model", "main"), out)
    assert commit == hub.repos["org/model"].commit("main")
    for name in ("config.json", "sub/tokenizer.json", "model.safetensors"):
        assert (out / name).read_bytes() == (repo_dir / name).read_bytes()
    assert not (out / "pytorch_model.bin").exists()
    downloaded = hub.downloads()
    assert sorted(p.rsplit("/", 1)[-1] for p in downloaded) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]

    # A second start (a restarted pod on a PVC cache) downloads nothing.
    assert fetch(HubRef("org/model", "main"), out) == commit
    assert hub.downloads() == downloaded

    # A new commit on the branch is fetched: only what changed would be new on a real hub too.
    (repo_dir / "config.json").write_text(json.dumps({"model_type": "llama", "v": 2}))
    assert fetch(HubRef("org/model", "main"), out) != commit
    assert json.loads((out / "config.json").read_text())["v"] == 2


def test_commit_revision_is_accepted(hub: HubMirror, tmp_path: Path) -> None:
    commit = hub.repos["org/model"].commit("main")
    assert fetch(HubRef("org/model", commit), tmp_path / "out") == commit


@pytest.mark.parametrize(
    ("repo", "revision", "token", "reason"),
    [
        ("org/missing", "main", None, "RepositoryNotFound"),
        ("org/model", "v9", None, "RevisionNotFound"),
        ("org/gated", "main", None, "AccessDenied"),
        ("org/gated", "main", "hf_wrong", "AccessDenied"),
    ],
)
def test_failures_name_their_cause(
    hub: HubMirror,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    repo: str,
    revision: str,
    token: str | None,
    reason: str,
) -> None:
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(FetchError) as caught:
        fetch(HubRef(repo, revision), tmp_path / "out", attempts=3, backoff_seconds=0)
    assert caught.value.reason == reason
    assert "model." in str(caught.value), "the message names the spec field to fix"
    # Permanent failures are not retried: one revision request per attempt made.
    assert sum(1 for _, p in hub.requests if "/revision/" in p) == 1


def test_gated_repo_with_token(hub: HubMirror, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    fetch(HubRef("org/gated", "main"), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").stat().st_size == 200_000


def test_outage_is_retried_with_backoff(
    hub: HubMirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub.repos["org/model"].unavailable_requests = 2
    fetch(HubRef("org/model", "main"), tmp_path / "out", attempts=3, backoff_seconds=0)
    assert (tmp_path / "out" / "config.json").exists()
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2

    hub.repos["org/model"].unavailable_requests = 5
    with pytest.raises(FetchError) as caught:
        fetch(HubRef("org/model", "main"), tmp_path / "again", attempts=2, backoff_seconds=0)
    assert caught.value.reason == "DownloadFailed"


def _plimsoll() -> str:
    return str(Path(sys.executable).with_name("plimsoll"))


@pytest.mark.parametrize("entry", ["plimsoll fetch", "python -m"], ids=["cli", "module"])
def test_cli_exit_code_and_termination_message(hub: HubMirror, tmp_path: Path, entry: str) -> None:
    """Both entry points: ``plimsoll fetch`` and the init container's ``python -m plimsoll.model_fetch``."""
    command = (
        [_plimsoll(), "fetch"]
        if entry == "plimsoll fetch"
        else [sys.executable, "-m", "plimsoll.model_fetch"]
    )
    term = tmp_path / "termination-log"
    env = {**os.environ, "PLIMSOLL_TERMINATION_LOG": str(term)}
    proc = subprocess.run(
        [*command, "hf://org/missing", "--local-dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == FETCH_EXIT_CODES["RepositoryNotFound"], proc.stderr
    assert term.read_text().startswith("RepositoryNotFound: repository org/missing not found")
    ok = subprocess.run(
        [*command, "hf://org/model@main", "--local-dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "downloaded" in ok.stderr and "fetched org/model" in ok.stderr


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare for a small tmpfs")
def test_disk_full_before_downloading(hub: HubMirror, tmp_path: Path) -> None:
    """A cache volume smaller than the model: refused up front, with the sizes, nothing half-written.

    The volume is a real 64 KiB tmpfs in a private mount namespace (no root needed
    where unprivileged user namespaces are allowed)."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged mount namespaces are not allowed here: {probe.stderr.decode().strip()}")
    volume = tmp_path / "volume"
    volume.mkdir()
    term = tmp_path / "termination-log"
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {volume} && "
        f"{_plimsoll()} fetch hf://org/model --local-dir {volume}/org/model/main; code=$?; "
        f"ls -A {volume}/org/model/main; exit $code"
    )
    env = {**os.environ, "PLIMSOLL_TERMINATION_LOG": str(term)}
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == FETCH_EXIT_CODES["DiskFull"], proc.stderr
    assert term.read_text().startswith(
        "DiskFull: org/model needs 195.3 KiB more but the cache volume has 64.0 KiB free"
    )
    assert "model.cache.sizeLimit" in term.read_text()
    assert proc.stdout.strip() == "", "nothing written to the volume"
    assert hub.downloads() == []


def test_a_tampered_cache_is_caught_by_hash_not_size(hub: HubMirror, repo_dir: Path, tmp_path: Path) -> None:
    """Same size, other bytes (someone wrote into the cache volume): downloaded again, not served."""
    out = tmp_path / "cache"
    commit = fetch(HubRef("org/model", "main"), out)
    weights = out / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(bytes(b ^ 0xFF for b in original[:64]) + original[64:])
    config = out / "config.json"
    config.write_text(config.read_text().replace("llama", "LLAMA"))  # a small non-LFS file, same size
    before = len(hub.downloads())
    assert fetch(HubRef("org/model", "main"), out) == commit
    assert weights.read_bytes() == (repo_dir / "model.safetensors").read_bytes()
    assert config.read_text() == (repo_dir / "config.json").read_text()
    again = sorted(p.rsplit("/", 1)[-1] for p in hub.downloads()[before:])
    assert again == ["config.json", "model.safetensors"]


def _hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the files ``matches`` reads (hashes) from now on."""
    from plimsoll import model_fetch

    seen: list[str] = []
    real = model_fetch.matches

    def counting(path: Path, expected: model_fetch.Expected) -> bool:
        seen.append(path.name)
        return real(path, expected)

    monkeypatch.setattr(model_fetch, "matches", counting)
    return seen


def _age_marker(out: Path) -> None:
    """Date the marker a second later than now: the checks it records are then older than it by more
    than a timestamp tick, as on a cache filled minutes or days before the pod starts."""
    marker = out / ".plimsoll-fetch.json"
    later = marker.stat().st_mtime_ns + 1_000_000_000
    os.utime(marker, ns=(later, later))


def test_a_warm_cache_is_trusted_by_its_stored_digests_not_rehashed(
    hub: HubMirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "node-cache"
    commit = fetch(HubRef("org/model", "main"), out)
    recorded = json.loads((out / ".plimsoll-fetch.json").read_text())["verified"]
    assert recorded["model.safetensors"]["digest"].startswith("sha256:")
    assert recorded["config.json"]["digest"].startswith("blob:")
    _age_marker(out)
    hashed = _hashed(monkeypatch)
    before = len(hub.downloads())
    assert fetch(HubRef("org/model", "main"), out) == commit
    assert hashed == [], "files unchanged since their check are not read again"
    assert len(hub.downloads()) == before
    # --rehash reads them all.
    assert fetch(HubRef("org/model", "main"), out, rehash=True) == commit
    assert sorted(hashed) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_rewrite_that_restores_size_and_mtime_is_still_caught(
    hub: HubMirror, repo_dir: Path, tmp_path: Path
) -> None:
    """ctime cannot be set back: same size, same mtime, other bytes is hashed and repaired."""
    out = tmp_path / "node-cache"
    fetch(HubRef("org/model", "main"), out)
    _age_marker(out)
    weights = out / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    with weights.open("r+b") as f:  # in place: the inode stays
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_ino == st.st_ino
    before = len(hub.downloads())
    fetch(HubRef("org/model", "main"), out)
    assert weights.read_bytes() == (repo_dir / "model.safetensors").read_bytes()
    assert [p.rsplit("/", 1)[-1] for p in hub.downloads()[before:]] == ["model.safetensors"]


def test_only_the_missing_file_is_downloaded(hub: HubMirror, repo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "node-cache"
    fetch(HubRef("org/model", "main"), out)
    (out / "sub" / "tokenizer.json").unlink()
    before = len(hub.downloads())
    fetch(HubRef("org/model", "main"), out)
    assert [p.rsplit("/", 1)[-1] for p in hub.downloads()[before:]] == ["tokenizer.json"]
    assert (out / "sub" / "tokenizer.json").read_bytes() == (repo_dir / "sub" / "tokenizer.json").read_bytes()


def test_fetches_of_one_directory_at_once_download_it_once(hub: HubMirror, tmp_path: Path) -> None:
    """Pods starting together on one node (and the fill DaemonSet) share the node's cache directory."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path / "node-cache"
    with ThreadPoolExecutor(3) as pool:
        commits = set(pool.map(lambda _: fetch(HubRef("org/model", "main"), out), range(3)))
    assert len(commits) == 1
    assert sorted(p.rsplit("/", 1)[-1] for p in hub.downloads()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_make_dir_creates_the_compile_cache_directory_for_this_user(hub: HubMirror, tmp_path: Path) -> None:
    """``--make-dir``: the engine's compile-cache directory on the volume, private to the image's user."""
    compile_dir = tmp_path / "cache" / "compile"
    ok = subprocess.run(
        [sys.executable, "-m", "plimsoll.model_fetch", "hf://org/model@main", "--local-dir", str(tmp_path / "cache" / "m"),
         "--make-dir", str(compile_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert compile_dir.is_dir() and compile_dir.stat().st_uid == os.getuid()
    assert compile_dir.stat().st_mode & 0o777 == 0o700
