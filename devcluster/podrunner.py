"""The pod runner: a kubelet-like loop that runs plimsoll pods as local processes.

It watches every pod bound to one of the simulated nodes; for a pod that runs
locally (``podspec.runs_locally``: a plimsoll image, a ``plimsoll`` command, or the
``plimsoll.dev/run-locally: "true"`` annotation) and that kwok has given a
loopback pod IP, it starts a :class:`PodWorker`, which runs the containers as
local processes bound to that IP and reports status as a kubelet would. Other
pods are left to kwok's simulated lifecycle (``stages.py``).

Started by ``Cluster(pod_runner=True)`` as ``python -m plimsoll.devcluster.podrunner``.
On SIGTERM it stops every pod process it started (SIGTERM, then SIGKILL) and
exits. It is not a kubelet: no images, no isolation, no resource limits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import shlex
import signal
from pathlib import Path
from typing import Any

import httpx

from plimsoll.devcluster import paths, podspec
from plimsoll.devcluster.kubeapi import KubeAPI, KubeAPIError
from plimsoll.devcluster.podworker import PodWorker, RunnerConfig
from plimsoll.devcluster.process import ProcessRecord

log = logging.getLogger("plimsoll.devcluster.podrunner")
READY_FILE = "runner.ready"


def stop_leftover_pods(records_dir: Path, timeout: float = 5.0) -> None:
    """Stop every pod process recorded under ``records_dir`` that still runs."""
    if not records_dir.is_dir():
        return
    for path in records_dir.glob("*.proc.json"):
        try:
            record = ProcessRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue
        record.stop(timeout=timeout)
        path.unlink(missing_ok=True)


def pod_processes(records_dir: Path, namespace: str, pod: str) -> dict[str, ProcessRecord]:
    """The live container processes the runner started for one pod, by container name.

    ``records_dir`` is the runner's state dir (``<cluster state dir>/pods``); each
    container's record is ``<namespace>_<pod>_<container>.proc.json``, written when
    the process starts and removed when it exits. Tests use it to find a PID to kill.
    """
    found = {}
    prefix = f"{namespace}_{pod}_"
    for path in records_dir.glob(f"{prefix}*.proc.json"):
        try:
            record = ProcessRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue  # being written or removed right now
        if record.is_alive():
            found[path.name.removeprefix(prefix).removesuffix(".proc.json")] = record
    return found


class PodRunner:
    """Watches pods and keeps one :class:`PodWorker` per locally run pod (by UID)."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self.api = KubeAPI(config.kubeconfig)
        self.workers: dict[str, tuple[PodWorker, asyncio.Task[None]]] = {}
        self.shutdown = asyncio.Event()

    def handle(self, event_type: str, pod: dict[str, Any]) -> None:
        """React to one pod as listed or watched."""
        if pod.get("spec", {}).get("nodeName") not in self.config.nodes or not podspec.runs_locally(pod):
            return
        meta, status = pod["metadata"], pod.get("status", {})
        uid = meta["uid"]
        entry = self.workers.get(uid)
        if event_type == "DELETED":
            if entry is not None:
                entry[0].request_stop(grace=2.0, delete=False)  # force-deleted: no grace left
            return
        if meta.get("deletionTimestamp"):
            grace = float(meta.get("deletionGracePeriodSeconds", 30))
            if entry is not None:
                entry[0].request_stop(grace=grace, delete=True)
            else:
                self._spawn_task(self.api.delete_pod_now(meta["namespace"], meta["name"], uid))
            return
        if entry is None and status.get("podIP") and status.get("phase") not in ("Succeeded", "Failed"):
            if not ipaddress.ip_address(status["podIP"]).is_loopback:
                # The loopback rule: never bind to or probe an address outside 127.0.0.0/8.
                log.error(
                    "%s/%s: pod IP %s is not loopback; not running it",
                    meta["namespace"],
                    meta["name"],
                    status["podIP"],
                )
                return
            worker = PodWorker(self.api, pod, self.config)
            task = asyncio.create_task(self._run_worker(uid, worker))
            self.workers[uid] = (worker, task)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _run_worker(self, uid: str, worker: PodWorker) -> None:
        try:
            await worker.run()
        except Exception:
            log.exception("%s/%s: pod worker failed", worker.namespace, worker.name)
        finally:
            self.workers.pop(uid, None)

    async def watch(self) -> None:
        """List, then watch from the list's resourceVersion; relist when the watch ends or expires."""
        ready_file = self.config.state_dir / READY_FILE
        while not self.shutdown.is_set():
            try:
                listing = await self.api.list_pods()
                for pod in listing["items"]:
                    self.handle("ADDED", pod)
                ready_file.touch()
                rv = listing["metadata"]["resourceVersion"]
                async for event in self.api.watch_pods(rv):
                    kind = event.get("type")
                    if kind == "ERROR":
                        break  # typically 410 Gone: relist
                    if kind == "BOOKMARK":
                        continue
                    self.handle(str(kind), event["object"])
            except (httpx.HTTPError, KubeAPIError, OSError) as exc:
                log.warning("watch interrupted (%s); relisting", exc)
                await asyncio.sleep(1.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown.set)
        watcher = asyncio.create_task(self.watch())
        await self.shutdown.wait()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        for worker, _ in list(self.workers.values()):
            worker.request_stop(grace=5.0, delete=False)
        tasks = [task for _, task in list(self.workers.values())]
        if tasks:
            await asyncio.wait(tasks, timeout=15.0)
        await self.api.aclose()
        (self.config.state_dir / READY_FILE).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m plimsoll.devcluster.podrunner", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True, help="logs, scratch dirs and PID records")
    parser.add_argument("--node", action="append", required=True, help="a simulated node whose pods to run")
    parser.add_argument("--model-cache", type=Path, default=None, help="local dir for model volumes")
    parser.add_argument(
        "--image-entrypoint",
        action="append",
        default=[],
        metavar="PART=COMMAND",
        help="run containers of images whose name holds PART with COMMAND as their entrypoint",
    )
    args = parser.parse_args(argv)
    entrypoints = []
    for item in args.image_entrypoint:
        part, sep, command = item.partition("=")
        if not sep or not part or not command.strip():
            parser.error(
                f"--image-entrypoint {item!r}: write PART=COMMAND, e.g. vllm='/venv/bin/python -m ...'"
            )
        entrypoints.append((part, tuple(shlex.split(command))))
    config = RunnerConfig(
        kubeconfig=args.kubeconfig.resolve(),
        state_dir=args.state_dir.resolve(),
        nodes=frozenset(args.node),
        model_cache=(args.model_cache or paths.model_cache_dir()).resolve(),
        entrypoints=tuple(entrypoints),
    )
    config.state_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop_leftover_pods(config.state_dir)
    asyncio.run(PodRunner(config).run())


if __name__ == "__main__":
    main()
