"""Fixtures for the operator's Kubernetes tests.

``operator_release``: the Helm chart installed once (CRD, ServiceAccount, RBAC; the
chart's own operator pod is simulated, not run). ``running_operator``: the real
operator as a local process authenticated as the chart's ServiceAccount, so it
has exactly the chart's permissions. ``llms_namespace``: a fresh namespace per test.
"""

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import Receiver

from plimsoll.operator.local import OperatorProcess, token_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "plimsoll"
RELEASE = "plimsoll"
RELEASE_NAMESPACE = "plimsoll-system"


@pytest.fixture(scope="session")
def operator_release(devcluster: Any) -> str:
    """Install the chart (CRDs, RBAC, ServiceAccount); return the ServiceAccount name."""
    devcluster.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)
    devcluster.helm(
        "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        "--set", "rbac.scope=cluster",  # every test makes its own namespace (the default is namespaced)
        "--set-string", "podAnnotations.plimsoll\\.dev/run-locally=false",
        "--wait", "--timeout", "120s",
    )  # fmt: skip
    devcluster.kubectl("wait", "--for=condition=Established", "crd/llmservices.plimsoll.dev", "--timeout=60s")
    return RELEASE  # fullname == release name when it contains the chart name


@pytest.fixture(scope="session")
def operator_traces() -> Iterator[Receiver]:
    """Where the session's operator sends its spans (--otlp-traces-endpoint, via the env var)."""
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="session")
def running_operator(
    devcluster: Any, operator_release: str, tmp_path_factory: pytest.TempPathFactory, operator_traces: Receiver
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
        extra_env={
            "PLIMSOLL_RESYNC_SECONDS": "5",
            "PLIMSOLL_DISCOVERY_TTL_SECONDS": "3",
            "PLIMSOLL_IMAGE": "ghcr.io/plimsoll/plimsoll:test",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": operator_traces.url,
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms between span exports
        },
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()
        # An RBAC denial names the subject ("User \"system:serviceaccount:...\" cannot ...");
        # other 403s (a namespace being deleted under a test) are not permission gaps.
        forbidden = [
            line
            for line in process.log_tail(400_000).splitlines()
            if "system:serviceaccount:" in line and "cannot" in line
        ]
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
        # Not waited for: the simulated nodes have GPUs to spare for the next test's pods.
        devcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
