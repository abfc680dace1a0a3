"""A local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok as local processes, with simulated GPU nodes.

``Cluster`` starts the components in order, waits for each to be ready, records
every PID in a state file (so `plimsoll dev down` in another process can stop
them) and stops exactly those processes. Everything binds to and talks to
127.0.0.0/8: pods get IPs from 127.1.0.0/16 (kwok ``--cidr``; the next free
127.N.0.0/16 when another local control plane holds it, see ``podnet.py``),
Services from 127.2.0.0/16; ClusterIPs are never contacted, and EndpointSlices for loopback pods
are rejected by the API server (so nothing may rely on them).

It does not build binaries (``builder.py``) and runs no containers: pods are
simulated by kwok, or, with ``pod_runner=True``, plimsoll pods are started as
local processes by ``podrunner.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from plimsoll.devcluster import paths
from plimsoll.devcluster.nodes import DEFAULT_NODES, SimulatedNode
from plimsoll.devcluster.pki import PKIFiles, create_pki, write_kubeconfig
from plimsoll.devcluster.podnet import claim_pod_cidr, release_pod_cidr
from plimsoll.devcluster.process import ComponentError, ProcessRecord, rss_bytes, start_process
from plimsoll.devcluster.stages import kwok_config

POD_CIDR = "127.1.0.0/16"
SERVICE_CIDR = "127.2.0.0/16"
KUBERNETES_SERVICE_IP = "127.2.0.1"
STATE_FILE = "state.json"
# Stop order: the reverse of start order, clients before the servers they talk to.
START_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "pod-runner")


class CommandError(subprocess.CalledProcessError):
    """kubectl or helm failed; the message carries its stderr."""

    def __str__(self) -> str:
        cmd = " ".join(str(c) for c in self.cmd) if isinstance(self.cmd, list) else str(self.cmd)
        return f"`{cmd}` exited with {self.returncode}: {(self.stderr or '').strip()}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    """What `plimsoll dev status` shows for one process."""

    name: str
    pid: int
    alive: bool
    rss_bytes: int
    log: str


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Cluster:
    """One local control plane, started by :meth:`start` or attached with :meth:`load`.

    Public helpers other parts use: ``kubeconfig``, ``env``, ``kubectl()``, ``helm()``.
    """

    def __init__(
        self,
        state_dir: Path | None = None,
        *,
        nodes: Sequence[SimulatedNode] = DEFAULT_NODES,
        pod_runner: bool = False,
        start_timeout: float = 180.0,
        image_entrypoints: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.state_dir = (state_dir or paths.default_state_dir()).resolve()
        self.nodes = tuple(nodes)
        self.pod_runner = pod_runner
        # Image name part -> local command for its entrypoint (the pod runner's --image-entrypoint).
        self.image_entrypoints = {k: list(v) for k, v in (image_entrypoints or {}).items()}
        self.start_timeout = start_timeout
        self.kubeconfig = self.state_dir / "admin.kubeconfig"
        self.pki = PKIFiles(self.state_dir / "pki")
        self.log_dir = self.state_dir / "logs"
        self.ports: dict[str, int] = {}
        self.pod_cidr = POD_CIDR  # the range claimed at start (POD_CIDR unless another cluster holds it)
        self.records: dict[str, ProcessRecord] = {}
        self._popens: dict[str, subprocess.Popen[bytes]] = {}
        self.env = self._make_env()

    # ---- public helpers -------------------------------------------------

    @property
    def server(self) -> str:
        """The API server URL (``https://127.0.0.1:<port>``)."""
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster; raise :class:`CommandError` on failure if ``check``."""
        return self._run([str(paths.binary("kubectl")), *args], input, check, timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the built helm against this cluster; raise :class:`CommandError` on failure if ``check``."""
        return self._run([str(paths.binary("helm")), *args], input, check, timeout)

    def apply(self, manifest: dict[str, Any] | str) -> subprocess.CompletedProcess[str]:
        """``kubectl apply -f -`` of one object (a dict) or YAML text."""
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", input=text)

    def get_json(self, *args: str) -> Any:
        """``kubectl get <args> -o json``, parsed. A leading ``"get"`` is accepted too (no resource is named so)."""
        if args and args[0] == "get":
            args = args[1:]
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def _run(
        self, argv: list[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, input=input, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise CommandError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def _make_env(self) -> dict[str, str]:
        path_dirs = [str(paths.PRODUCTS["k8s"].bin_dir), str(paths.PRODUCTS["helm"].bin_dir)]
        helm_home = self.state_dir / "helm"
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": os.pathsep.join([*path_dirs, os.environ.get("PATH", "")]),
            # Keep helm's repositories and cache out of the user's home.
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }

    # ---- lifecycle -----------------------------------------------------

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every component and the simulated nodes; on any failure stop what started, then raise."""
        missing = paths.missing_products()
        if missing:
            raise ComponentError(
                "build",
                f"binaries not built yet for {', '.join(missing)}; run `plimsoll dev up` (builds them) "
                f"or `{paths.BUILD_SCRIPT} {' '.join(missing)}`",
            )
        self._fresh_state_dir()
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise

    def _fresh_state_dir(self) -> None:
        if (self.state_dir / STATE_FILE).exists():
            previous = Cluster.load(self.state_dir)
            if any(r.is_alive() for r in previous.records.values()):
                raise ComponentError(
                    "cluster",
                    f"a control plane from {self.state_dir} is still running; stop it with `plimsoll dev down`",
                )
            previous.stop()  # dead leftovers: pod processes a killed runner left behind
        for sub in ("etcd", "pki", "logs", "kcm", "helm", "pods"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir()

    def _start_all(self) -> None:
        self.ports = {name: free_port() for name in ("etcd", "etcd_peer", "apiserver", "kcm", "scheduler")}
        self.pod_cidr = claim_pod_cidr(self.state_dir / STATE_FILE, POD_CIDR)
        create_pki(self.pki.dir, extra_ips=(KUBERNETES_SERVICE_IP,))
        write_kubeconfig(self.kubeconfig, self.pki, self.server)

        self._spawn("etcd", self._etcd_argv())
        self._wait("etcd", self._deadline(), self._etcd_ready)
        self._spawn("kube-apiserver", self._apiserver_argv())
        self._wait(
            "kube-apiserver",
            self._deadline(),
            lambda: self._https_ok(self.ports["apiserver"], "/readyz", True),
        )
        self._spawn("kube-controller-manager", self._kcm_argv())
        self._spawn("kube-scheduler", self._scheduler_argv())
        self._wait(
            "kube-controller-manager", self._deadline(), lambda: self._https_ok(self.ports["kcm"], "/healthz")
        )
        self._wait(
            "kube-scheduler", self._deadline(), lambda: self._https_ok(self.ports["scheduler"], "/healthz")
        )
        kwok_cfg = self.state_dir / "kwok.yaml"
        kwok_cfg.write_text(kwok_config(paths.kwok_stages(), self.pod_runner))
        self._spawn("kwok", self._kwok_argv(kwok_cfg))
        for node in self.nodes:
            self.apply(node.manifest())
        self._wait("kwok", self._deadline(), self._nodes_ready)
        # The default ServiceAccount proves kcm's controllers run; pods need it to be admitted.
        self._wait(
            "kube-controller-manager",
            self._deadline(),
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0
            ),
        )
        if self.pod_runner:
            self._spawn("pod-runner", self._pod_runner_argv(), env=self._pod_runner_env())
            ready_file = self.state_dir / "pods" / "runner.ready"
            self._wait("pod-runner", self._deadline(), ready_file.exists)

    def _deadline(self) -> float:
        return time.monotonic() + self.start_timeout

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM→SIGKILL every recorded process (reverse start order) and forget them."""
        for name in reversed(START_ORDER):
            record = self.records.get(name)
            if record is not None:
                record.stop(timeout=timeout, popen=self._popens.get(name))
        # Pod processes the runner started are in their own sessions; if the runner
        # died before stopping them, stop them here from its record.
        from plimsoll.devcluster.podrunner import stop_leftover_pods

        stop_leftover_pods(self.state_dir / "pods")
        self.records.clear()
        self._popens.clear()
        release_pod_cidr(self.state_dir / STATE_FILE, self.pod_cidr)
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)

    @classmethod
    def load(cls, state_dir: Path | None = None) -> Cluster:
        """Attach to a control plane started by another process, from its state file."""
        state_dir = (state_dir or paths.default_state_dir()).resolve()
        state_path = state_dir / STATE_FILE
        if not state_path.is_file():
            raise FileNotFoundError(
                f"no control plane state in {state_dir}; start one with `plimsoll dev up`"
            )
        data = json.loads(state_path.read_text())
        nodes = tuple(SimulatedNode(n["name"], int(n["gpus"])) for n in data.get("nodes", []))
        cluster = cls(state_dir, nodes=nodes, pod_runner=bool(data.get("pod_runner", False)))
        cluster.ports = {k: int(v) for k, v in data["ports"].items()}
        cluster.pod_cidr = str(data.get("pod_cidr", POD_CIDR))
        cluster.records = {r["name"]: ProcessRecord.from_json(r) for r in data["processes"]}
        return cluster

    def status(self) -> list[ComponentStatus]:
        """Each recorded process: alive or not, resident memory, log path."""
        out = []
        for name in START_ORDER:
            r = self.records.get(name)
            if r is not None:
                alive = r.is_alive()
                out.append(ComponentStatus(name, r.pid, alive, rss_bytes(r.pid) if alive else 0, r.log))
        return out

    def is_running(self) -> bool:
        return bool(self.records) and all(r.is_alive() for r in self.records.values())

    def resident_memory(self) -> int:
        """Sum of the control plane processes' RSS in bytes (pods started by the runner excluded)."""
        return sum(s.rss_bytes for s in self.status())

    # ---- internals -----------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        record, popen = start_process(name, argv, self.log_dir / f"{name}.log", env=env, cwd=self.state_dir)
        self.records[name] = record
        self._popens[name] = popen
        self._save()

    def _save(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "pod_runner": self.pod_runner,
            "pod_cidr": self.pod_cidr,
            "nodes": [{"name": n.name, "gpus": n.gpus} for n in self.nodes],
            "processes": [self.records[n].to_json() for n in START_ORDER if n in self.records],
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)

    def _wait(self, name: str, deadline: float, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until true; fail fast if the component's process exits."""
        record = self.records[name]
        while True:
            popen = self._popens.get(name)
            if popen is not None and popen.poll() is not None:
                raise ComponentError(
                    name, f"exited with status {popen.returncode} while starting", Path(record.log)
                )
            try:
                if ready():
                    return
            except (httpx.HTTPError, OSError, subprocess.SubprocessError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ComponentError(name, f"not ready after {self.start_timeout:.0f}s", Path(record.log))
            time.sleep(0.25)

    def _etcd_ready(self) -> bool:
        r = httpx.get(f"http://127.0.0.1:{self.ports['etcd']}/health", timeout=2.0)
        return r.status_code == 200 and r.json().get("health") == "true"

    def _https_ok(self, port: int, path: str, verify_apiserver: bool = False) -> bool:
        if verify_apiserver:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
            ctx.load_cert_chain(str(self.pki.admin_crt), str(self.pki.admin_key))
        else:
            # kcm and the scheduler serve a self-signed cert from their cert dir; these
            # health checks go to 127.0.0.1 only and carry no credentials.
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        r = httpx.get(f"https://127.0.0.1:{port}{path}", verify=ctx, timeout=3.0)
        return r.status_code == 200

    def _nodes_ready(self) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return False
        ready = {
            item["metadata"]["name"]
            for item in json.loads(out.stdout)["items"]
            for cond in item.get("status", {}).get("conditions", [])
            if cond["type"] == "Ready" and cond["status"] == "True"
        }
        return all(n.name in ready for n in self.nodes)

    def _etcd_argv(self) -> list[str]:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        return [
            str(paths.binary("etcd")),
            "--name=plimsoll-dev",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=plimsoll-dev={peer}",
            "--unsafe-no-fsync",  # test data; fsync costs seconds on a loaded disk
            "--log-level=warn",
        ]

    def _apiserver_argv(self) -> list[str]:
        p = self.pki
        port = self.ports["apiserver"]
        return [
            str(paths.binary("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            # Without it the apiserver looks for a default route's address.
            "--advertise-address=127.0.0.1",
            # Endpoints/EndpointSlices may not hold loopback addresses: no reconciler.
            "--endpoint-reconciler-type=none",
            f"--cert-dir={p.dir}",
            f"--tls-cert-file={p.apiserver_crt}",
            f"--tls-private-key-file={p.apiserver_key}",
            f"--client-ca-file={p.ca_crt}",
            f"--service-account-issuer=https://127.0.0.1:{port}",
            f"--service-account-key-file={p.sa_pub}",
            f"--service-account-signing-key-file={p.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            "--v=1",
        ]

    def _kcm_argv(self) -> list[str]:
        p = self.pki
        kc = str(self.kubeconfig)
        return [
            str(paths.binary("kube-controller-manager")),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['kcm']}",
            f"--cert-dir={self.state_dir / 'kcm'}",
            "--leader-elect=false",
            "--controllers=*",
            f"--service-account-private-key-file={p.sa_key}",
            f"--root-ca-file={p.ca_crt}",
            f"--cluster-signing-cert-file={p.ca_crt}",
            f"--cluster-signing-key-file={p.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--horizontal-pod-autoscaler-sync-period=5s",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            "--v=1",
        ]

    def _scheduler_argv(self) -> list[str]:
        cfg = self.state_dir / "scheduler.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(self.kubeconfig)},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        kc = str(self.kubeconfig)
        return [
            str(paths.binary("kube-scheduler")),
            f"--config={cfg}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['scheduler']}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            "--v=1",
        ]

    def _kwok_argv(self, config: Path) -> list[str]:
        return [
            str(paths.binary("kwok")),
            f"--kubeconfig={self.kubeconfig}",
            f"--config={config}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-lease-duration-seconds=40",
            f"--cidr={self.pod_cidr}",
            "--node-ip=127.0.0.1",
        ]

    def _pod_runner_argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "plimsoll.devcluster.podrunner",
            "--kubeconfig",
            str(self.kubeconfig),
            "--state-dir",
            str(self.state_dir / "pods"),
            *[arg for n in self.nodes for arg in ("--node", n.name)],
            *[
                arg
                for part, command in self.image_entrypoints.items()
                for arg in ("--image-entrypoint", f"{part}={shlex.join(command)}")
            ],
        ]

    def _pod_runner_env(self) -> dict[str, str]:
        return {**self.env, "PYTHONUNBUFFERED": "1"}
