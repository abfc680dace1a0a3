"""One locally run pod: its container processes, their probes, restarts and status.

A ``PodWorker`` does for one pod what a kubelet does: resolves env and mounts,
starts each container's command as a local process in its own session (log file
under the runner's state dir; ``kubectl logs`` cannot reach it, an Event names the
file), runs startup, readiness and liveness probes against the pod IP (readiness
and liveness wait for the startup probe, as in a kubelet), restarts exited
containers per ``restartPolicy`` with back-off, patches the pod status on every
change, and on deletion sends SIGTERM, waits the grace period, SIGKILLs, and
removes the pod object. Translation rules are in ``podspec.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from plimsoll.devcluster import podspec
from plimsoll.devcluster.kubeapi import KubeAPI, KubeAPIError
from plimsoll.devcluster.podspec import ContainerState, Probe
from plimsoll.devcluster.process import ProcessRecord, start_ticks

log = logging.getLogger("plimsoll.devcluster.podrunner")

# Restart back-off: kubelet uses 10 s doubling to 5 min; a dev loop wants faster feedback.
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# A container that ran this long without trouble restarts after the first back-off again (kubelet: 10 min),
# so a replica killed once late in a long session is not held back by crashes long past.
BACKOFF_RESET_S = 60.0


def restart_backoff(current: float, ran_s: float) -> float:
    """The back-off before the next restart, given the one used last time and how long the container ran."""
    return BACKOFF_START_S if ran_s >= BACKOFF_RESET_S else current


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Validated settings of the pod runner."""

    kubeconfig: Path
    state_dir: Path
    nodes: frozenset[str]
    model_cache: Path
    # image name part -> the local command standing in for that image's entrypoint
    entrypoints: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"


@dataclass(frozen=True, slots=True)
class ContainerPlan:
    """How one container runs here: command line, env, probes, preStop sleep."""

    argv: list[str]
    env: dict[str, str]
    startup: Probe
    readiness: Probe
    liveness: Probe
    pre_stop_sleep_s: float
    logs_as_message: bool = False  # terminationMessagePolicy FallbackToLogsOnError


class PodWorker:
    """Runs one pod's containers until the pod is deleted."""

    def __init__(self, api: KubeAPI, pod: dict[str, Any], config: RunnerConfig) -> None:
        self.api = api
        self.pod = pod
        self.config = config
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.pod_ip: str = pod["status"]["podIP"]
        self.restart_policy: str = pod["spec"].get("restartPolicy", "Always")
        self.containers = [ContainerState(c["name"], c.get("image", "")) for c in pod["spec"]["containers"]]
        self.init_containers = [
            ContainerState(c["name"], c.get("image", "")) for c in pod["spec"].get("initContainers") or []
        ]
        self.conditions: list[dict[str, Any]] = list(pod.get("status", {}).get("conditions", []))
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.stopping = asyncio.Event()
        self.grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.delete_when_stopped = False
        self._publish_lock = asyncio.Lock()
        self.slug = f"{self.namespace}_{self.name}"

    # ---- called by the runner -----------------------------------------

    def request_stop(self, grace: float | None, delete: bool) -> None:
        """The pod is being deleted: stop within ``grace`` s, then delete the object if ``delete``."""
        if grace is not None:
            self.grace = grace
        self.delete_when_stopped = self.delete_when_stopped or delete
        self.stopping.set()

    async def run(self) -> None:
        try:
            specs = await self._prepare()
        except (ValueError, KubeAPIError) as exc:
            for c in self.containers:
                c.reason, c.message = "CreateContainerConfigError", str(exc)
            await self._publish()
            await self._event("Warning", "Failed", f"Error: {exc}")
            await self.stopping.wait()
        else:
            if await self._run_init_containers(specs):
                tasks = [asyncio.create_task(self._run_container(c, specs[c.name])) for c in self.containers]
                await asyncio.gather(*tasks)
            else:
                await self.stopping.wait()
        if self.delete_when_stopped:
            await self.api.delete_pod_now(self.namespace, self.name, self.uid)

    # ---- preparation ---------------------------------------------------

    async def _prepare(self) -> dict[str, ContainerPlan]:
        scratch = self.config.state_dir / "scratch" / self.slug
        base_env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        base_env["HOSTNAME"] = self.name
        sa_kubeconfig = await self._service_account_kubeconfig()
        if sa_kubeconfig is not None:
            base_env["KUBECONFIG"] = str(sa_kubeconfig)
        out = {}
        for spec in [*(self.pod["spec"].get("initContainers") or []), *self.pod["spec"]["containers"]]:
            mounts = podspec.local_mounts(self.pod, spec, self.config.model_cache, scratch)
            for local in mounts.values():
                local.mkdir(parents=True, exist_ok=True)
            pod_env = await self._container_env(spec)
            env = {**base_env, **podspec.map_env_paths(pod_env, mounts)}
            argv = podspec.container_argv(spec, pod_env, self.pod_ip, mounts, dict(self.config.entrypoints))
            pre_stop = ((spec.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
            out[spec["name"]] = ContainerPlan(
                argv=argv,
                env=env,
                startup=Probe.from_spec(spec.get("startupProbe"), spec),
                readiness=Probe.from_spec(spec.get("readinessProbe"), spec),
                liveness=Probe.from_spec(spec.get("livenessProbe"), spec),
                pre_stop_sleep_s=float(pre_stop.get("seconds", 0)),
                logs_as_message=spec.get("terminationMessagePolicy") == "FallbackToLogsOnError",
            )
        return out

    async def _service_account_kubeconfig(self) -> Path | None:
        """A kubeconfig with the pod's ServiceAccount token, standing in for the in-cluster mount."""
        if self.pod["spec"].get("automountServiceAccountToken") is False:
            return None
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        try:
            token = await self.api.service_account_token(self.namespace, sa)
        except KubeAPIError as exc:
            log.warning("%s/%s: no token for ServiceAccount %s: %s", self.namespace, self.name, sa, exc)
            return None
        path = self.config.state_dir / "scratch" / self.slug / "kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(self.api.token_kubeconfig(token, self.namespace))
        return path

    async def _container_env(self, spec: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in spec.get("envFrom", []) or []:
            kind, ref = (
                ("Secret", source["secretRef"])
                if "secretRef" in source
                else ("ConfigMap", source["configMapRef"])
            )
            data = await self.api.get_data(kind, self.namespace, ref["name"])
            if data is None and not ref.get("optional", False):
                raise ValueError(f"{kind.lower()} {ref['name']!r} not found")
            env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
        for item in spec.get("env", []) or []:
            name = item["name"]
            if "valueFrom" not in item:
                env[name] = podspec.expand_refs(item.get("value", ""), env)
                continue
            vf = item["valueFrom"]
            if "fieldRef" in vf:
                env[name] = podspec.field_ref(self.pod, vf["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind, ref = (
                    ("Secret", vf["secretKeyRef"])
                    if "secretKeyRef" in vf
                    else ("ConfigMap", vf["configMapKeyRef"])
                )
                data = await self.api.get_data(kind, self.namespace, ref["name"])
                value = None if data is None else data.get(ref["key"])
                if value is None:
                    if ref.get("optional", False):
                        continue
                    raise ValueError(
                        f"env {name}: key {ref['key']!r} of {kind.lower()} {ref['name']!r} not found"
                    )
                env[name] = value
            else:
                raise ValueError(f"env {name}: valueFrom {sorted(vf)} is not supported by the pod runner")
        return env

    # ---- init containers -----------------------------------------------

    async def _run_init_containers(self, specs: dict[str, ContainerPlan]) -> bool:
        """Run each init container to completion, in order, restarting a failed one with back-off
        (unless restartPolicy is Never). False when the pod stops (or fails) before all completed."""
        if not self.init_containers:
            return True
        for c in self.containers:
            c.reason = "PodInitializing"
        for c in self.init_containers:
            plan = specs[c.name]
            backoff = BACKOFF_START_S
            logfile = self.config.log_dir / f"{self.slug}_{c.name}.log"
            logfile.parent.mkdir(parents=True, exist_ok=True)
            while True:
                if self.stopping.is_set():
                    return False
                with logfile.open("ab") as out:
                    out.write(
                        f"\n==== {now()} starting (restart {c.restart_count}): {' '.join(plan.argv)}\n".encode()
                    )
                    out.flush()
                    proc = await asyncio.create_subprocess_exec(
                        *plan.argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                        env=plan.env, cwd=str(self.config.state_dir), start_new_session=True,
                    )  # fmt: skip
                self.procs[c.name] = proc
                c.state, c.reason, c.message, c.started_at = "running", "", "", now()
                await self._publish()
                await self._event(
                    "Normal", "Started", f"Started init container {c.name} as PID {proc.pid}; log: {logfile}"
                )
                stop_wait = asyncio.create_task(self.stopping.wait())
                exit_wait = asyncio.create_task(proc.wait())
                await asyncio.wait({stop_wait, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not exit_wait.done():
                    await self._terminate(c, proc, 0)
                code = await exit_wait
                stop_wait.cancel()
                c.state, c.finished_at = "terminated", now()
                c.exit_code = code if code >= 0 else 128 - code
                c.reason = "Completed" if c.exit_code == 0 else "Error"
                c.message = _log_tail(logfile) if c.exit_code != 0 and plan.logs_as_message else ""
                c.ready = c.exit_code == 0
                await self._publish()
                if c.exit_code == 0:
                    break
                if self.stopping.is_set() or self.restart_policy == "Never":
                    return False
                c.last_message = c.message
                await self._back_off(c, f"init container {c.name}", backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        for c in self.containers:
            c.reason = "ContainerCreating"
        return True

    # ---- one container -------------------------------------------------

    async def _run_container(self, c: ContainerState, plan: ContainerPlan) -> None:
        argv, env = plan.argv, plan.env
        backoff = BACKOFF_START_S
        logfile = self.config.log_dir / f"{self.slug}_{c.name}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        record_path = self.config.state_dir / f"{self.slug}_{c.name}.proc.json"
        while not self.stopping.is_set():
            with logfile.open("ab") as out:
                out.write(f"\n==== {now()} starting (restart {c.restart_count}): {' '.join(argv)}\n".encode())
                out.flush()
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                        env=env, cwd=str(self.config.state_dir), start_new_session=True,
                    )  # fmt: skip
                except OSError as exc:
                    c.state, c.reason, c.message = "waiting", "RunContainerError", str(exc)
                    await self._publish()
                    await self._event("Warning", "Failed", f"Error: {exc}")
                    await self._sleep_unless_stopping(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                    continue
            self.procs[c.name] = proc
            record = ProcessRecord(
                f"{self.slug}_{c.name}", proc.pid, start_ticks(proc.pid) or 0, str(logfile), argv
            )
            record_path.write_text(json.dumps(record.to_json()))
            c.state, c.reason, c.message, c.started_at = "running", "", "", now()
            c.ready = plan.readiness.kind == "none" and plan.startup.kind == "none"
            await self._publish()
            await self._event(
                "Normal",
                "Started",
                f"Started container {c.name} as PID {proc.pid} on {self.pod_ip}; log: {logfile}",
            )

            ran_since = asyncio.get_running_loop().time()
            probes = asyncio.create_task(self._probes(c, plan, proc))
            stop_wait = asyncio.create_task(self.stopping.wait())
            exit_wait = asyncio.create_task(proc.wait())
            await asyncio.wait({stop_wait, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not exit_wait.done():
                await self._terminate(c, proc, plan.pre_stop_sleep_s)
            code = await exit_wait
            stop_wait.cancel()
            probes.cancel()
            record_path.unlink(missing_ok=True)
            c.state, c.ready, c.finished_at = "terminated", False, now()
            c.exit_code = code if code >= 0 else 128 - code  # killed by signal N -> 128+N, like a shell
            c.reason = "Completed" if c.exit_code == 0 else "Error"
            backoff = restart_backoff(backoff, asyncio.get_running_loop().time() - ran_since)
            await self._publish()
            if self.stopping.is_set():
                return
            if not (
                self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and c.exit_code != 0)
            ):
                await self._event("Normal" if c.exit_code == 0 else "Warning", "Completed" if c.exit_code == 0 else "Failed",
                                  f"container {c.name} exited with code {c.exit_code}")  # fmt: skip
                return
            await self._back_off(c, f"container {c.name}", backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _back_off(self, c: Any, what: str, backoff: float) -> None:
        """A failed container waits in CrashLoopBackOff for ``backoff`` seconds, as the kubelet does."""
        await self._event(
            "Warning", "BackOff", f"{what} exited with code {c.exit_code}; restarting in {backoff:.0f}s"
        )
        c.last_exit_code, c.last_started_at, c.last_finished_at = c.exit_code, c.started_at, c.finished_at
        c.state, c.reason, c.message = (
            "waiting",
            "CrashLoopBackOff",
            f"back-off {backoff:.0f}s restarting failed container",
        )
        c.restart_count += 1
        await self._publish()
        await self._sleep_unless_stopping(backoff)

    async def _terminate(
        self, c: ContainerState, proc: asyncio.subprocess.Process, pre_stop_s: float
    ) -> None:
        await self._event("Normal", "Killing", f"Stopping container {c.name} (grace {self.grace:.0f}s)")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        if pre_stop_s > 0:
            # The preStop sleep hook runs inside the grace period, before SIGTERM.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=min(pre_stop_s, self.grace))
        _killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=max(deadline - loop.time(), 0.1))
        except TimeoutError:
            _killpg(proc.pid, signal.SIGKILL)
        # Children of the container's process that outlived it.
        _killpg(proc.pid, signal.SIGKILL)

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)

    # ---- probes --------------------------------------------------------

    async def _probe_once(self, probe: Probe) -> bool:
        try:
            if probe.kind == "tcp":
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.pod_ip, probe.port), probe.timeout
                )
                writer.close()
                return True
            url = f"{probe.scheme.lower()}://{self.pod_ip}:{probe.port}{probe.path}"
            async with httpx.AsyncClient(timeout=probe.timeout, verify=False) as client:
                r = await client.get(url)
            return 200 <= r.status_code < 400
        except (httpx.HTTPError, OSError, TimeoutError):
            return False

    async def _probes(self, c: ContainerState, plan: ContainerPlan, proc: asyncio.subprocess.Process) -> None:
        """Startup first; readiness and liveness only once it succeeded (kubelet order)."""
        if plan.startup.kind != "none":
            if not await self._startup(c, plan.startup, proc):
                return
            if plan.readiness.kind == "none":
                c.ready = True
                await self._publish()
        checks = [self._readiness(c, plan.readiness)]
        if plan.liveness.kind != "none":
            checks.append(self._liveness(c, plan.liveness, proc))
        await asyncio.gather(*checks)

    async def _startup(self, c: ContainerState, probe: Probe, proc: asyncio.subprocess.Process) -> bool:
        await asyncio.sleep(probe.initial_delay)
        failures = 0
        while True:
            if await self._probe_once(probe):
                return True
            failures += 1
            if failures >= probe.failure_threshold:
                await self._event(
                    "Warning", "Unhealthy", f"Startup probe failed {failures} times; killing {c.name}"
                )
                _killpg(proc.pid, signal.SIGKILL)
                return False
            await asyncio.sleep(probe.period)

    async def _readiness(self, c: ContainerState, probe: Probe) -> None:
        if probe.kind == "none":
            return
        await asyncio.sleep(probe.initial_delay)
        successes = failures = 0
        while True:
            if await self._probe_once(probe):
                successes, failures = successes + 1, 0
                if not c.ready and successes >= probe.success_threshold:
                    c.ready = True
                    await self._publish()
            else:
                successes, failures = 0, failures + 1
                if c.ready and failures >= probe.failure_threshold:
                    c.ready = False
                    await self._publish()
                    await self._event("Warning", "Unhealthy", f"Readiness probe failed for {c.name}")
            await asyncio.sleep(probe.period)

    async def _liveness(self, c: ContainerState, probe: Probe, proc: asyncio.subprocess.Process) -> None:
        await asyncio.sleep(probe.initial_delay)
        failures = 0
        while True:
            failures = 0 if await self._probe_once(probe) else failures + 1
            if failures >= probe.failure_threshold:
                await self._event(
                    "Warning", "Unhealthy", f"Liveness probe failed {failures} times; killing {c.name}"
                )
                _killpg(proc.pid, signal.SIGKILL)
                return
            await asyncio.sleep(probe.period)

    # ---- status --------------------------------------------------------

    async def _publish(self) -> None:
        async with self._publish_lock:
            status = podspec.pod_status(
                self.containers, self.restart_policy, self.conditions, now(), self.init_containers
            )
            try:
                await self.api.patch_pod_status(self.namespace, self.name, status)
                self.conditions = status["conditions"]
            except (KubeAPIError, httpx.HTTPError) as exc:
                log.warning("%s/%s: status patch failed: %s", self.namespace, self.name, exc)

    async def _event(self, kind: str, reason: str, message: str) -> None:
        log.info("%s/%s %s: %s", self.namespace, self.name, reason, message)
        try:
            await self.api.post_event(self.pod, kind, reason, message, now())
        except (KubeAPIError, httpx.HTTPError) as exc:
            log.warning("%s/%s: event not posted: %s", self.namespace, self.name, exc)


def _log_tail(path: Path, limit: int = 2048) -> str:
    """The end of a container's log, as a kubelet's FallbackToLogsOnError keeps (80 lines, 2 KiB)."""
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-80:])


def _killpg(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
