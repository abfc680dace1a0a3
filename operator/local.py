"""Run the operator as a local process against a cluster, optionally as a ServiceAccount.

Used by the Kubernetes tests, ``benchmarks/operator_scale.py`` and ``plimsoll demo``:
the operator runs exactly as in its pod (``plimsoll operator``), but on this
machine, with a kubeconfig that carries a ServiceAccount token so it holds
exactly the chart's RBAC permissions and nothing more. This module starts and
stops that one process (by its own PID) and never touches others.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import yaml


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def token_kubeconfig(admin_kubeconfig: Path, token: str, path: Path, user: str = "operator") -> Path:
    """Write a kubeconfig that reuses the admin's cluster entry but authenticates with ``token``."""
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": cluster["name"], "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class OperatorProcess:
    """One `plimsoll operator` process with its own liveness port and log file."""

    kubeconfig: Path
    log_path: Path
    namespaces: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def liveness_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"

    def start(self, timeout: float = 60.0) -> None:
        """Start the operator and wait until its liveness endpoint answers."""
        argv = [sys.executable, "-c", "from plimsoll.cli import main; main()", "operator", "--verbose"]
        argv += ["--liveness", self.liveness_url]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        env: dict[str, Any] = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            **self.extra_env,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"operator exited with {self.process.returncode}; log:\n{self.log_tail()}")
            if self.is_alive():
                return
            time.sleep(0.3)
        raise TimeoutError(f"operator liveness did not answer in {timeout:.0f}s; log:\n{self.log_tail()}")

    def is_alive(self) -> bool:
        """Whether the liveness endpoint answers 200."""
        try:
            return httpx.get(self.liveness_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, kill: bool = False, timeout: float = 15.0) -> None:
        """SIGTERM (or SIGKILL, to simulate a crash) the operator and wait for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the process has used (Linux /proc)."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def rss_bytes(self) -> int:
        """Resident memory of the process (Linux /proc)."""
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


@contextlib.contextmanager
def chart_operator(cluster: Any, chart: Path, workdir: Path, **extra_env: str) -> Iterator[OperatorProcess]:
    """Install the chart (its operator pod kept off the pod runner) and run the operator here.

    The operator runs as a local process with the chart's ServiceAccount token, so it
    has exactly the chart's RBAC; ``cluster`` is a ``plimsoll.devcluster`` Cluster.
    """
    cluster.kubectl("create", "namespace", "plimsoll-system")
    cluster.helm(
        "install", "plimsoll", str(chart), "-n", "plimsoll-system", "--set", "rbac.scope=cluster",
        "--set-string", "podAnnotations.plimsoll\\.dev/run-locally=false", "--wait", "--timeout", "120s",
    )  # fmt: skip
    token = cluster.kubectl("create", "token", "plimsoll", "-n", "plimsoll-system").stdout.strip()
    kubeconfig = token_kubeconfig(Path(cluster.kubeconfig), token, workdir / "sa.kubeconfig")
    env = {"PLIMSOLL_RESYNC_SECONDS": "5", "PLIMSOLL_IMAGE": "ghcr.io/plimsoll/plimsoll:test", **extra_env}
    operator = OperatorProcess(kubeconfig=kubeconfig, log_path=workdir / "operator.log", extra_env=env)
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()


@contextlib.contextmanager
def chart_cluster(
    chart: Path, prefix: str, *, pod_runner: bool = False, **extra_env: str
) -> Iterator[tuple[Any, OperatorProcess]]:
    """A throwaway ``plimsoll.devcluster`` Cluster in a temporary directory named ``prefix...``,
    with the chart installed and its operator running here (``chart_operator``): the benchmarks'
    setting. Yields the cluster and the operator."""
    import tempfile

    from plimsoll.devcluster.cluster import Cluster

    with (
        tempfile.TemporaryDirectory(prefix=prefix) as tmp,
        Cluster(Path(tmp) / "cluster", pod_runner=pod_runner) as cluster,
        chart_operator(cluster, chart, Path(tmp), **extra_env) as operator,
    ):
        yield cluster, operator
