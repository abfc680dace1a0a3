"""The simulated GPU nodes kwok manages: their names, GPU counts and Node manifests.

A node carries kwok's annotation (``kwok.x-k8s.io/node: fake``), which is how kwok
is told to manage it, and its capacity in ``status`` (the API server keeps a Node's
status on create; kwok's node-initialize stage then keeps those figures). No
taint is set, so pods need no toleration. It creates nothing by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
SIMULATED_LABEL = "plimsoll.dev/simulated-node"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class SimulatedNode:
    """One simulated node: GPUs, CPUs and memory it reports as allocatable."""

    name: str
    gpus: int
    cpu: str = "32"
    memory: str = "256Gi"
    pods: str = "110"
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"

    def manifest(self) -> dict[str, Any]:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods, GPU_RESOURCE: str(self.gpus)}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    SIMULATED_LABEL: "true",
                    # The label NVIDIA's GPU feature discovery sets; the operator may select on it.
                    "nvidia.com/gpu.product": self.gpu_product,
                    "nvidia.com/gpu.count": str(self.gpus),
                },
            },
            "spec": {},
            "status": {"capacity": dict(resources), "allocatable": dict(resources)},
        }


DEFAULT_NODES: tuple[SimulatedNode, ...] = (
    SimulatedNode("gpu-node-a", gpus=2),
    SimulatedNode("gpu-node-b", gpus=4),
)
