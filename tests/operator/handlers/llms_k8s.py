"""Helpers shared by the operator's Kubernetes tests and fixtures (polling, kubectl JSON, manifests)."""

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

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


def handler_passes(operator: Any, handler: str, namespace: str, name: str) -> int:
    """How often kopf logged ``handler`` (e.g. "Timer 'resync_llmservice'") succeeding for one object."""
    text = operator.log_path.read_text(errors="replace") if operator.log_path.exists() else ""
    return text.count(f"[{namespace}/{name}] {handler} succeeded.")


def wait_for_passes(
    operator: Any, handler: str, namespace: str, name: str, passes: int = 2, timeout: float = 120
) -> None:
    """Wait until ``handler`` has run ``passes`` more times for the object: the marker that lets a
    test say "the operator looked again and did nothing", rather than sleeping for a guessed time."""
    start = handler_passes(operator, handler, namespace, name)
    wait_for(
        lambda: handler_passes(operator, handler, namespace, name) >= start + passes,
        timeout,
        f"{passes} more passes of {handler} on {namespace}/{name}",
    )


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
        # No benchmark Jobs here: profiling has its own tests (test_profiling_*).
        "capacity": {"mode": "Manual", "concurrencyPerReplica": 4},
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
