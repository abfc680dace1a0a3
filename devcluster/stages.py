"""kwok's configuration: which lifecycle kwok simulates for which pods.

kwok ships "fast" stages (node initialise and heartbeat, pod ready, Job pod
complete, pod delete) which the build concatenates into ``stages.yaml``. Without
the pod runner they apply to every pod: pods turn Ready as soon as they are bound.

With the pod runner, pods that run locally (see :data:`RUN_LOCALLY_JQ`) are taken
out of kwok's ready, complete and delete stages; one extra stage only gives them
their loopback pod IP from kwok's pool (``--cidr``), and the runner does the rest
as a kubelet would: starts the process, probes it, patches the status, and
removes the pod after its process stopped. A backstop stage deletes such pods at
their ``deletionTimestamp`` (the end of the grace period) if no runner did.

This module only writes YAML; it starts nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# The annotation that forces a pod onto ("true") or off ("false") the pod runner.
RUN_LOCALLY_ANNOTATION = "plimsoll.dev/run-locally"

# jq (gojq, as kwok evaluates stage selectors) that is true for a pod the runner
# starts. Must agree with podspec.runs_locally(); tests check both.
RUN_LOCALLY_JQ = (
    f'(.metadata.annotations["{RUN_LOCALLY_ANNOTATION}"] // "") as $a'
    ' | if $a == "true" then true elif $a == "false" then false'
    ' else ([.spec.containers[] | ((.image // "") | contains("plimsoll"))'
    ' or (((.command // []) | first) == "plimsoll")] | any) end'
)

_NOT_LOCAL = {"key": RUN_LOCALLY_JQ, "operator": "NotIn", "values": ["true"]}
_LOCAL = {"key": RUN_LOCALLY_JQ, "operator": "In", "values": ["true"]}


# A pod status's KINDIP (the first address) and KINDIPs from the template variable $KINDIPs,
# for KIND host and pod (the kubelet writes both alike).
_IP_FIELDS = """\
{{ with $KINDIPs }}
KINDIP: {{ index . 0 | Quote }}
KINDIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
"""

# A pod whose containers are still being created: initialised, not Ready.
_NOT_READY_TEMPLATE = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    waiting:
      reason: ContainerCreating
{{ end }}
"""

# Gives a locally run pod its host and pod IPs, leaves it Pending and not Ready;
# the runner takes it from there.
_ASSIGN_IP_TEMPLATE = "".join(
    (
        _NOT_READY_TEMPLATE,
        "{{ $hostIPs := NodeIPsWith .spec.nodeName }}\n",
        _IP_FIELDS.replace("KIND", "host"),
        '{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) '
        '( or .metadata.name "" ) ( or .metadata.namespace "" ) }}\n',
        _IP_FIELDS.replace("KIND", "pod"),
        "phase: Pending\n",
        "startTime: {{ $now | Quote }}\n",
    )
)


def _stage(
    name: str, selector: list[dict[str, Any]], nxt: dict[str, Any], delay: dict[str, Any] | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {"matchExpressions": selector},
        "next": nxt,
    }
    if delay is not None:
        spec["delay"] = delay
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def local_pod_stages() -> list[dict[str, Any]]:
    """The two stages that apply only to locally run pods."""
    assign_ip = _stage(
        "plimsoll-local-pod-assign-ip",
        [
            {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
            {"key": ".status.podIP", "operator": "DoesNotExist"},
            _LOCAL,
        ],
        {"statusTemplate": _ASSIGN_IP_TEMPLATE},
    )
    backstop_delete = _stage(
        "plimsoll-local-pod-delete-backstop",
        [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}, _LOCAL],
        {"delete": True},
        # durationFrom a time = that time minus now: the end of the grace period.
        delay={
            "durationMilliseconds": 1000,
            "durationFrom": {"expressionFrom": ".metadata.deletionTimestamp"},
        },
    )
    return [assign_ip, backstop_delete]


def kwok_config(stock_stages: Path, pod_runner: bool) -> str:
    """The ``--config`` file for kwok: a KwokConfiguration plus every Stage."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokConfiguration",
            # kwok 0.8.0 does not default these when --config is given ("node leases
            # parallelism must be greater than 0"); the values are kwok's own defaults
            # except podPlayStageParallelism. kwok creates a CIDR's IP pool lazily on the
            # first pod IP it hands out, with a load-then-store that is not atomic: two
            # pod workers that both miss each make a pool, and the first pods of a new
            # cluster can get the same IP (a Deployment of 3 got 127.1.0.1 twice in CI).
            # One worker plays every pod stage in turn; each play is one PATCH.
            "options": {
                "podPlayStageParallelism": 1,
                "nodePlayStageParallelism": 4,
                "nodeLeaseParallelism": 4,
                "podsOnNodeSyncParallelism": 1,
            },
        }
    ]
    for stage in yaml.safe_load_all(stock_stages.read_text()):
        if not stage:
            continue
        if pod_runner and stage["spec"]["resourceRef"]["kind"] == "Pod":
            stage["spec"]["selector"].setdefault("matchExpressions", []).append(dict(_NOT_LOCAL))
        docs.append(stage)
    if pod_runner:
        docs.extend(local_pod_stages())
    return yaml.safe_dump_all(docs, sort_keys=False)
