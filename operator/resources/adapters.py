"""LoRA adapters on an LLMService's replicas: where each is in the pod, and what to load or unload. Pure.

What it is: two halves of ``spec.adapters``.

* The pod side (:func:`lora_flags`, :func:`adapter_placement`): ``--enable-lora
  --max-loras N [--max-lora-rank R]`` for either engine (plus vLLM's
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, without which its load endpoints do not exist),
  the read-only mounts of adapter claims other than the model's, and one ``plimsoll
  fetch`` init container per hf:// adapter. The adapter *list* is deliberately not in
  the pod template: no ``--lora-modules``. A template that named the adapters would roll
  every pod on each change, and an engine started with a bad ``--lora-modules`` entry
  exits, which is a crash loop; loaded through the API, a bad adapter is one refused
  request and a condition.
* The live side (:func:`plan_pod`, :func:`adapters_status`, :func:`adapters_condition`):
  given what each Ready pod's ``/v1/models`` lists (adapters are the cards whose
  ``parent`` is the base model), which adapters to load (``POST /v1/load_lora_adapter``)
  and unload on it, and what status and ``AdaptersReady`` condition follow from the
  answers.

What it is not: the HTTP calls or the status write (``handlers/adapters.py``), nor the
engine's adapter slots (``runtime``).
"""

import hashlib
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_adapter_uri, parse_model_uri
from plimsoll.operator.api.spec import DEFAULT_MAX_LORAS, RESERVED_VOLUME_PREFIX, AdapterSpec
from plimsoll.operator.api.status import ConditionVerdict
from plimsoll.operator.resources.model_fetch import MODEL_CACHE_MOUNT, MODEL_CACHE_VOLUME, hf_local_dir
from plimsoll.operator.resources.settings import MODEL_MOUNT

ADAPTER_MOUNT = "/mnt/adapters"
FETCH_ADAPTER_PREFIX = "fetch-adapter-"
VLLM_RUNTIME_LORA_ENV = {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}


def lora_flags(svc: LLMService) -> list[str]:
    """The engine flags LoRA needs (the same spelling in plimsoll and vLLM); [] with LoRA off."""
    if not svc.spec.lora_enabled():
        return []
    engine = svc.spec.engine
    flags = ["--enable-lora", "--max-loras", str(engine.max_loras or DEFAULT_MAX_LORAS)]
    if engine.max_lora_rank is not None:
        flags += ["--max-lora-rank", str(engine.max_lora_rank)]
    return flags


def claim_volume_name(claim: str) -> str:
    """A stable volume name per adapter claim (a DNS label, whatever the claim's length)."""
    return RESERVED_VOLUME_PREFIX + hashlib.sha256(claim.encode()).hexdigest()[:12]


def _model_claim(svc: LLMService) -> str | None:
    model = parse_model_uri(svc.spec.model.uri)
    return model.name if model.scheme == "pvc" else None


def adapter_path(svc: LLMService, adapter: AdapterSpec) -> str:
    """The directory the engine loads ``adapter`` from, inside the replica pod (vLLM's lora_path)."""
    location = parse_adapter_uri(adapter.uri)
    if location.scheme == "file":
        return location.name
    if location.scheme == "hf":
        return hf_local_dir(location)
    root = MODEL_MOUNT if location.name == _model_claim(svc) else f"{ADAPTER_MOUNT}/{location.name}"
    return f"{root}/{location.path}" if location.path else root


def adapter_roots(svc: LLMService) -> list[str]:
    """The directories run-time loads may read (``--lora-allowed-roots``): every mount point this module
    and the model use for adapters, whether or not one is declared yet (adding an adapter then changes
    no flag, so no pod restarts), plus ``engine.loraAllowedRoots`` for file:// adapters in the image."""
    return sorted({ADAPTER_MOUNT, MODEL_CACHE_MOUNT, MODEL_MOUNT, *svc.spec.engine.lora_allowed_roots})


def desired_adapters(svc: LLMService) -> dict[str, str]:
    """Every declared adapter's name → its path in the pod."""
    return {a.name: adapter_path(svc, a) for a in svc.spec.adapters}


@dataclass
class AdapterPlacement:
    """What the pod template needs so the adapters' directories exist in the engine container."""

    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    hf_locations: list[tuple[str, Any]] = field(default_factory=list)  # (adapter name, ModelLocation)
    needs_cache_volume: bool = False


def adapter_placement(svc: LLMService) -> AdapterPlacement:
    """Volumes and mounts for adapter claims (other than the model's), and the hf:// adapters to fetch."""
    placement = AdapterPlacement()
    claims: list[str] = []
    for adapter in svc.spec.adapters:
        location = parse_adapter_uri(adapter.uri)
        if location.scheme == "pvc" and location.name != _model_claim(svc) and location.name not in claims:
            claims.append(location.name)
        elif location.scheme == "hf":
            placement.hf_locations.append((adapter.name, location))
    for claim in sorted(claims):  # sorted: the template does not change with the adapters' order
        volume = claim_volume_name(claim)
        placement.volumes.append(
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        placement.mounts.append({"name": volume, "mountPath": f"{ADAPTER_MOUNT}/{claim}", "readOnly": True})
    if placement.hf_locations and parse_model_uri(svc.spec.model.uri).scheme != "hf":
        placement.needs_cache_volume = True
        placement.mounts.append({"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT, "readOnly": True})
    return placement


def fetch_container_name(adapter_name: str) -> str:
    """The init container downloading one hf:// adapter (a DNS label)."""
    digest = hashlib.sha256(adapter_name.encode()).hexdigest()[:12]
    return FETCH_ADAPTER_PREFIX + digest


# --- the live side ------------------------------------------------------------------------------


def loaded_adapters(models: dict[str, Any], base_model: str) -> dict[str, str]:
    """Adapters a ``/v1/models`` answer lists: name → path (vLLM's ``root``; "" when not given)."""
    found: dict[str, str] = {}
    for card in models.get("data") or []:
        if isinstance(card, dict) and card.get("parent") == base_model and card.get("id") != base_model:
            root = str(card.get("root") or "")
            # A replica shows the path only to its admin key's holder; a bare name is "not said".
            found[str(card["id"])] = root if root.startswith("/") else ""
    return found


@dataclass(frozen=True, slots=True)
class PodPlan:
    """What to do on one pod: (name, path) pairs to load, names to unload (a changed path is both)."""

    load: tuple[tuple[str, str], ...]
    unload: tuple[str, ...]


def plan_pod(desired: dict[str, str], loaded: dict[str, str]) -> PodPlan:
    """Loads and unloads that bring ``loaded`` to ``desired``.

    An adapter the pod holds from another path (the spec's uri changed) is unloaded and
    loaded again; a path the engine does not report ("") is taken to be the right one.
    """
    moved = sorted(n for n, p in loaded.items() if n in desired and p and p != desired[n])
    unload = sorted(n for n in loaded if n not in desired) + moved
    load = [(n, p) for n, p in sorted(desired.items()) if n not in loaded or n in moved]
    return PodPlan(load=tuple(load), unload=tuple(unload))


@dataclass(frozen=True, slots=True)
class PodAdapters:
    """One Ready pod after a pass: adapters it holds, loads it refused (name → the engine's message),
    and why it could not be asked at all (``error``)."""

    pod: str
    loaded: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    error: str | None = None


def adapters_status(svc: LLMService, pods: list[PodAdapters]) -> list[dict[str, Any]]:
    """``status.adapters``: per declared adapter, the pods holding it and the pods that refused it."""
    rows = []
    for adapter in svc.spec.adapters:
        loaded_on = sorted(p.pod for p in pods if adapter.name in p.loaded)
        failed = [{"pod": p.pod, "message": m} for p in pods for n, m in p.failed if n == adapter.name]
        row: dict[str, Any] = {"name": adapter.name, "uri": adapter.uri, "loadedOn": loaded_on}
        if failed:
            row["failures"] = sorted(failed, key=lambda f: f["pod"])
        rows.append(row)
    return rows


# ``AdaptersReady``: True when every Ready pod holds every declared adapter.
AdaptersCondition = ConditionVerdict


def adapters_condition(svc: LLMService, pods: list[PodAdapters]) -> AdaptersCondition:
    """The condition the pass's results imply. A refused load wins (the user must fix it)."""
    names = [a.name for a in svc.spec.adapters]
    failures = [f"{n} on {p.pod}: {m}" for p in pods for n, m in p.failed]
    if failures:
        return AdaptersCondition("False", "AdapterLoadFailed", "; ".join(failures))
    if not names:
        return AdaptersCondition("True", "NoAdapters", "no adapters declared")
    if not pods:
        return AdaptersCondition("Unknown", "NoReadyReplicas", "no Ready replica to load adapters on yet")
    unreachable = [f"{p.pod}: {p.error}" for p in pods if p.error]
    if unreachable:
        return AdaptersCondition("Unknown", "ReplicaUnreachable", "; ".join(unreachable))
    missing = [f"{n} on {p.pod}" for p in pods for n in names if n not in p.loaded]
    if missing:
        return AdaptersCondition("False", "Loading", "not loaded yet: " + ", ".join(missing))
    return AdaptersCondition(
        "True", "AdaptersLoaded", f"{len(names)} adapter(s) loaded on {len(pods)} Ready replica(s)"
    )
