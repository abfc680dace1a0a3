"""The simulator's LoRA adapters: vLLM's run-time adapter API and info gauge, without weights.

What it is: the adapter registry of one simulated replica (``simulator.py``). It takes
``--lora-modules name=path`` at start and ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` at run time with vLLM's bodies and answers; a path is
accepted when it is a directory holding ``adapter_config.json`` (a PEFT adapter's
marker file), so a test can make a load fail the way a real engine's does. It counts
requests per adapter and exports the Gateway API Inference Extension gauge
``<family>lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}``
(value: the time of the last change), which the router and the operator read.

What it is not: LoRA. Requests to an adapter are served exactly like the base model's;
``max_loras`` bounds nothing but the gauge's label, as it bounds only GPU slots in an
engine (more adapters may be registered than fit in a step).
"""

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from plimsoll import metric_names as mn


class AdapterError(ValueError):
    """A load or unload the simulated engine refuses; ``status`` is the HTTP answer (400 or 404)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` (vLLM's --lora-modules form) as a pair, or ValueError saying the form."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entry {text!r} is not name=path")
    return name, path


def adapter_problem(path: str) -> str | None:
    """Why ``path`` is not a loadable adapter directory, or None."""
    folder = Path(path)
    if not folder.is_dir():
        return f"lora_path {path!r} is not a directory"
    if not (folder / "adapter_config.json").is_file():
        return f"lora_path {path!r} has no adapter_config.json (not a PEFT adapter directory)"
    return None


class SimAdapters(Collector):
    """Adapters by name → path, requests per adapter, and the info gauge as a collector."""

    def __init__(self, base_model: str, modules: tuple[str, ...], max_loras: int, engine: str) -> None:
        self.base_model = base_model
        self.max_loras = max_loras
        self.metric = mn.LORA_REQUESTS_INFO if engine == "plimsoll" else mn.VLLM_LORA_REQUESTS_INFO
        self.paths: dict[str, str] = {}
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()
        self.changed_at = time.time()
        for entry in modules:
            name, path = parse_lora_module(entry)
            self.load(name, path)

    def load(self, name: str, path: str) -> None:
        """Register ``name``; AdapterError when the name is taken or the path is not an adapter."""
        if not name or not path:
            raise AdapterError("load_lora_adapter needs lora_name and lora_path")
        if name == self.base_model:
            raise AdapterError(f"lora_name {name!r} is the base model's name; pick another")
        if name in self.paths:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        problem = adapter_problem(path)
        if problem is not None:
            raise AdapterError(problem)
        self.paths[name] = path
        self._touch()

    def unload(self, name: str) -> None:
        """Forget ``name``; AdapterError 404 when no such adapter is loaded, 400 while it has requests."""
        if name not in self.paths:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", status=404)
        if self.running[name] or self.waiting[name]:
            raise AdapterError(
                f"The lora adapter '{name}' has {self.running[name] + self.waiting[name]} request(s) "
                "in flight; retry once they finish"
            )
        del self.paths[name]
        self._touch()

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (``parent`` = the base model, as vLLM lists them)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "plimsoll-sim",
                "root": path,
                "parent": self.base_model,
            }
            for name, path in self.paths.items()
        ]

    def queued(self, model: str) -> None:
        if model in self.paths:
            self.waiting[model] += 1
            self._touch()

    def started(self, model: str) -> None:
        if model in self.paths:
            self.waiting[model] -= 1
            self.running[model] += 1
            self._touch()

    def finished(self, model: str, was_running: bool) -> None:
        if model not in self.paths:
            return  # the base model (unload refuses an adapter with requests in flight)
        (self.running if was_running else self.waiting)[model] -= 1
        self._touch()

    def _touch(self) -> None:
        self.changed_at = time.time()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        def names(counts: Counter[str]) -> str:
            return ",".join(sorted(n for n, c in counts.items() if c > 0))

        family = GaugeMetricFamily(
            self.metric,
            "Running and waiting LoRA adapters; value: when this last changed (unix seconds).",
            labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        )
        family.add_metric([names(self.running), names(self.waiting), str(self.max_loras)], self.changed_at)
        yield family
