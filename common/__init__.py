"""plimsoll: serve LLMs on Kubernetes below their saturation line.

The distribution holds four parts, each importable on its own:
``plimsoll.runtime`` (inference server), ``plimsoll.bench`` (saturation finder),
``plimsoll.operator`` (kopf operator) and ``plimsoll.router`` (LLM-aware proxy),
plus ``plimsoll.devcluster``, the local Kubernetes control plane used by tests
and ``plimsoll dev``. This package is the shared core: version, CLI entry and
the metric names every part agrees on.
"""

__version__ = "0.1.0"
