"""Router test fixtures (the helpers live in router_harness.py so tests can import them by a unique name)."""

from router_harness import fake_replicas

__all__ = ["fake_replicas"]
