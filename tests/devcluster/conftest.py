"""Fixtures for the control-plane tests: a fresh namespace per test."""

import uuid
from collections.abc import Iterator

import pytest

from plimsoll.devcluster.cluster import Cluster


@pytest.fixture
def namespace(devcluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    devcluster.kubectl("create", "namespace", name)
    yield name
    devcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
