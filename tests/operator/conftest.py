"""Fixtures for the operator's Kubernetes tests.

``operator_release``: the Helm chart installed once (CRD, ServiceAccount, RBAC; the
chart's own operator pod is simulated, not run). ``running_operator``: the real
operator as a local process authenticated as the chart's ServiceAccount, so it
has exactly the chart's permissions. ``llms_namespace``: a fresh namespace per test.
"""

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.operator.local import OperatorProcess, token_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "plimsoll"
RELEASE = "plimsoll"
RELEASE_NAMESPACE = "plimsoll-system"
# Replica pods are simulated by kwok: they are scheduled, get a loopback IP and turn
# Ready, but no engine process starts (the devcluster pod runner skips them).
SIMULATED = {"plimsoll.dev/run-locally": "false"}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def get_json(cluster: Any, *args: str) -> Any:
    """`kubectl get ... -o json`, or None when the object does not exist."""
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return None


def llmservice(name: str, **spec: Any) -> dict[str, Any]:
    """A simulated, CPU-only LLMService manifest; ``spec`` overrides the defaults."""
    body: dict[str, Any] = {
        "model": {"uri": "embedded://smollm2-135m"},
        "resources": {"gpu": {"count": 0}},
        "autoscaling": {"mode": "off"},
        "replicas": 1,
        "podAnnotations": SIMULATED,
    }
    body.update(spec)
    return {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": body,
    }


def apply(cluster: Any, namespace: str, manifest: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=check)


@pytest.fixture(scope="session")
def operator_release(devcluster: Any) -> str:
    """Install the chart (CRDs, RBAC, ServiceAccount); return the ServiceAccount name."""
    devcluster.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)
    devcluster.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        "--set-string", "podAnnotations.plimsoll\\.dev/run-locally=false",
        "--wait", "--timeout", "120s",
    )  # fmt: skip
    devcluster.kubectl("wait", "--for=condition=Established", "crd/llmservices.plimsoll.dev", "--timeout=60s")
    return RELEASE  # fullname == release name when it contains the chart name


@pytest.fixture(scope="session")
def running_operator(
    devcluster: Any, operator_release: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator, local process, authenticated with a token of the chart's ServiceAccount."""
    token = devcluster.kubectl(
        "create", "token", operator_release, "-n", RELEASE_NAMESPACE, "--duration=4h"
    ).stdout.strip()
    folder = tmp_path_factory.mktemp("operator")
    kubeconfig = token_kubeconfig(Path(devcluster.kubeconfig), token, folder / "sa.kubeconfig")
    process = OperatorProcess(
        kubeconfig=kubeconfig,
        log_path=folder / "operator.log",
        extra_env={"PLIMSOLL_RESYNC_SECONDS": "5", "PLIMSOLL_IMAGE": "ghcr.io/plimsoll/plimsoll:test"},
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()
        forbidden = [line for line in process.log_tail(200_000).splitlines() if "Forbidden" in line]
        assert not forbidden, "the operator hit RBAC denials with the chart's permissions:\n" + "\n".join(
            forbidden[:10]
        )


@pytest.fixture
def llms_namespace(devcluster: Any, running_operator: OperatorProcess) -> Iterator[str]:
    name = f"llms-{uuid.uuid4().hex[:6]}"
    devcluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        # LLMServices have no finalizer, so the namespace goes without the operator's help.
        devcluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=90s", check=False)
