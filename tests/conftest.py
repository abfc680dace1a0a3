"""Test-run-wide fixtures. Part-specific fixtures live in each tests/<part>/conftest.py.

``devcluster``: one local Kubernetes control plane (etcd, kube-apiserver,
controller-manager, scheduler, kwok with simulated GPU nodes, and the pod runner)
shared by every test marked ``k8s``; started on first use, stopped at the end.
Use ``devcluster.kubectl(...)``, ``devcluster.helm(...)``, ``devcluster.kubeconfig``
and ``devcluster.env`` (os.environ + KUBECONFIG + PATH with kubectl/helm first).
"""

from collections.abc import Iterator

import pytest

from plimsoll.devcluster.cluster import Cluster


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` where torch sees no CUDA device (they run on a GPU machine)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from plimsoll.devcluster import paths
    from plimsoll.devcluster.builder import ensure_built

    if paths.missing_products():
        # Normally .ci/run (or `plimsoll dev up --build-only`) has built them already.
        print(
            f"\nbuilding control-plane binaries {paths.missing_products()} (first run only; see devcluster/build.sh)"
        )
        ensure_built()
    cluster = Cluster(tmp_path_factory.mktemp("devcluster"), pod_runner=True)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
