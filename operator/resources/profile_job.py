"""The capacity-profiling Job of an LLMService and the least-privilege RBAC it runs with. Pure.

What it is: builders for the objects one profile needs — a ServiceAccount, a
Role that may read and update exactly one ConfigMap, its RoleBinding, that
ConfigMap (created empty by the operator, so the Job's Role never needs
``create``), and the Job itself: the plimsoll image running
``plimsoll bench sweep`` against one replica pod's IP with the spec's workload
and SLOs, then holding the recommendation for ``capacity.verifySeconds``
(stepping down until it holds), publishing its JSON report into the ConfigMap (key ``report.json``).

What it is not: the decision when to profile or how to read the result
(``operator/handlers/profiling.py`` and ``operator/scaling/profile.py``); it
never talks to a cluster.
"""

import hashlib
import shlex
from typing import Any

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.credentials import api_key_env
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.settings import ENGINE_PORT, BuildSettings

PROFILE_COMPONENT = "profile"
SPEC_HASH_ANNOTATION = "plimsoll.dev/spec-hash"
# Extra `plimsoll bench sweep` flags, e.g. looser client gates on a shared CPU.
PROFILE_ARGS_ANNOTATION = "plimsoll.dev/profile-args"
REPORT_KEY = "report.json"
WORK_MOUNT = "/profile"
# The least a profile Job may run before Kubernetes stops it; a sweep whose levels and
# floors add up to more gets three times its floors (see ``profile_deadline_seconds``).
ACTIVE_DEADLINE_SECONDS = 3600
# The load generator belongs on another machine than the replica it measures: sharing the
# node's CPUs and network with it makes the server look slower than it is.
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
# A finished Job stays this long; while a failed one exists the operator does not
# retry, so this is also the back-off between failed attempts.
TTL_AFTER_FINISHED_SECONDS = 600
# Flags the operator sets itself; the annotation may not override them.
_RESERVED_FLAGS = ("--url", "--model", "--output", "-o", "--report-configmap")


class ProfileArgsError(ValueError):
    """The ``plimsoll.dev/profile-args`` annotation cannot be used."""


def profile_name(svc: LLMService, spec_hash: str) -> str:
    """Name of the Job and ConfigMap for one measured spec: ``<svc>-profile-<8 hex of the hash>``.

    The hash in the name makes a restarted operator find the Job it started for
    the current spec instead of starting a second one.
    """
    digest = hashlib.sha256(spec_hash.encode()).hexdigest()[:8]
    return f"{svc.name[:40]}-profile-{digest}"


def profiler_account_name(svc: LLMService) -> str:
    """ServiceAccount, Role and RoleBinding name shared by every profile of ``svc``."""
    return f"{svc.name[:45]}-profiler"


def _owner(svc: LLMService) -> list[dict[str, Any]]:
    if svc.metadata.uid is None:
        return []  # builders are also used for previews (no uid yet); the handler adopts with kopf
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": svc.name,
            "uid": svc.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _meta(svc: LLMService, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": svc.namespace,
        "labels": common_labels(svc, PROFILE_COMPONENT),
    }
    if annotations:
        meta["annotations"] = annotations
    owners = _owner(svc)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def build_profiler_rbac(svc: LLMService, configmap: str, *running: str) -> list[dict[str, Any]]:
    """ServiceAccount + Role (get/update/patch of the report ConfigMap) + RoleBinding.

    ``running``: the report ConfigMaps of the service's other Jobs still to write theirs (a split
    service profiles both pools at once under the one account); the Role keeps them writable.
    """
    name = profiler_account_name(svc)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(svc, name)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(svc, name),
            # resourceNames cannot restrict `create`, so the operator creates the ConfigMap
            # and the Job may only fill it in.
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": sorted({configmap, *running}),
                    "verbs": ["get", "update", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(svc, name),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": svc.namespace}],
        },
    ]


def build_report_configmap(svc: LLMService, spec_hash: str) -> dict[str, Any]:
    """The empty ConfigMap the Job writes its report into."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(svc, profile_name(svc, spec_hash), {SPEC_HASH_ANNOTATION: spec_hash}),
        "data": {},
    }


def extra_profile_args(svc: LLMService) -> list[str]:
    """The flags in the ``plimsoll.dev/profile-args`` annotation; raises ProfileArgsError when unusable."""
    text = svc.metadata.annotations.get(PROFILE_ARGS_ANNOTATION, "")
    try:
        args = shlex.split(text)
    except ValueError as error:
        raise ProfileArgsError(
            f"annotation {PROFILE_ARGS_ANNOTATION} is not a shell word list: {error}"
        ) from error
    reserved = [a for a in args if a.split("=", 1)[0] in _RESERVED_FLAGS]
    if reserved:
        raise ProfileArgsError(
            f"annotation {PROFILE_ARGS_ANNOTATION} may not set {', '.join(reserved)}: the operator sets "
            "the target, model and report location itself"
        )
    return args


def sweep_args(svc: LLMService, pod_ip: str, configmap: str) -> list[str]:
    """The `plimsoll bench sweep` command line for ``svc`` against the pod at ``pod_ip``."""
    workload = svc.spec.capacity.profile.workload
    slo = svc.spec.slo
    # A preset's objectives (applied because the spec sets none) are not the user's promise of
    # how long requests may wait: the sweep then finds where the replica saturates (server
    # queueing, floored latency inflation) instead of how far a 3 s TTFT would stretch it.
    # The preset still drives the autoscaler's attainment and the alerts.
    measured = (
        {}
        if slo.defaulted_from
        else {
            "--slo-ttft-p95-ms": slo.ttft_p95_ms,
            "--slo-tpot-p50-ms": slo.tpot_p50_ms,
            "--slo-e2e-p95-ms": slo.e2e_p95_ms,
        }
    )
    args = [
        "bench", "sweep",
        "--url", f"http://{pod_ip}:{ENGINE_PORT}",
        "--model", svc.served_name,
        "--input-tokens", str(workload.input_tokens),
        "--output-tokens", str(workload.output_tokens),
        "--levels", ",".join(str(c) for c in workload.concurrency),
        "--headroom", str(svc.spec.capacity.headroom),
        "--verify-seconds", str(svc.spec.capacity.verify_seconds),
    ]  # fmt: skip
    if workload.requests_per_level is not None:  # else bench's own max(100, 4 × c)
        args += ["--requests-per-level", str(workload.requests_per_level)]
    if workload.min_seconds_per_level > 0:
        args += ["--min-duration-per-level", str(workload.min_seconds_per_level)]
    for flag, value in measured.items():
        if value is not None:
            args += [flag, str(value)]
    args += [*extra_profile_args(svc), "--output", f"{WORK_MOUNT}/report.json"]
    return [*args, "--report-configmap", f"{svc.namespace}/{configmap}"]


def profile_deadline_seconds(svc: LLMService) -> int:
    """How long the Job may run: an hour, or three times what its floors alone take (each level's
    minimum seconds and the hold's at most four attempts), whichever is longer."""
    workload = svc.spec.capacity.profile.workload
    floors = len(workload.concurrency) * workload.min_seconds_per_level + 4 * svc.spec.capacity.verify_seconds
    return max(ACTIVE_DEADLINE_SECONDS, 3 * floors)


def load_generator_affinity(svc: LLMService) -> dict[str, Any]:
    """Keep the Job off the nodes running ``svc``'s replicas (pod anti-affinity by hostname).

    Preferred, not required: on a one-node cluster (kind, minikube, a single GPU box) a
    required rule would leave the profile Pending forever. The operator records the node
    each side ran on in ``status.capacity.measured`` and says so when they shared one.
    """
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": selector_labels(svc)},
                        "topologyKey": HOSTNAME_TOPOLOGY,
                    },
                }
            ]
        }
    }


def build_profile_job(
    svc: LLMService,
    pod_ip: str,
    settings: BuildSettings,
    spec_hash: str,
    *,
    active_deadline_seconds: int | None = None,
    ttl_seconds_after_finished: int = TTL_AFTER_FINISHED_SECONDS,
) -> dict[str, Any]:
    """The Job that measures one replica (``pod_ip``) of ``svc`` for the spec whose hash is ``spec_hash``.

    Raises ProfileArgsError when the profile-args annotation is unusable.
    """
    name = profile_name(svc, spec_hash)
    container = {
        "name": "bench",
        "image": settings.plimsoll_image,
        "command": ["plimsoll"],
        "args": sweep_args(svc, pod_ip, name),
        # The sweep sends the replicas' API key (from its Secret, never in the args); HOME and TMPDIR on
        # the work volume because the root filesystem is read-only.
        "env": [
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HOME", "value": WORK_MOUNT},
            {"name": "TMPDIR", "value": WORK_MOUNT},
            *api_key_env(svc),
        ],
        # The tail of the log becomes the termination message, which the operator quotes
        # in the Profiled condition when the sweep fails (`kubectl logs` needs no access then).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
        },
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"cpu": "2", "memory": "2Gi"},
        },
        "volumeMounts": [{"name": "work", "mountPath": WORK_MOUNT}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(svc, name, {SPEC_HASH_ANNOTATION: spec_hash}),
        "spec": {
            # One attempt: a failed sweep is reported, and retried only after the back-off.
            "backoffLimit": 0,
            "activeDeadlineSeconds": active_deadline_seconds or profile_deadline_seconds(svc),
            "ttlSecondsAfterFinished": ttl_seconds_after_finished,
            "template": {
                "metadata": {
                    "labels": common_labels(svc, PROFILE_COMPONENT),
                    "annotations": {SPEC_HASH_ANNOTATION: spec_hash},
                },
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": profiler_account_name(svc),
                    "enableServiceLinks": False,
                    "affinity": load_generator_affinity(svc),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "runAsGroup": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "work", "emptyDir": {"sizeLimit": "1Gi"}}],
                },
            },
        },
    }
