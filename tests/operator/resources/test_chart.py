"""The Helm chart: strict lint, schema, rendered RBAC; install/upgrade/uninstall on the local control plane."""

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.devcluster import paths

CHART = Path(__file__).resolve().parents[3] / "charts" / "plimsoll"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = paths.binary("helm")
    assert binary.exists(), f"{binary} missing; build it with `bash devcluster/build.sh`"
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "plimsoll", str(CHART), "--namespace", "plimsoll-system"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def test_lint_strict_passes() -> None:
    helm("lint", "--strict", str(CHART))
    helm(
        "lint", "--strict", str(CHART), "--set", "rbac.scope=namespaced", "--set", "watchNamespaces={team-a}"
    )


def test_schema_refuses_unknown_and_wrong_values() -> None:
    typo = helm("lint", "--strict", str(CHART), "--set", "rbac.scop=namespaced", check=False)
    assert typo.returncode != 0
    assert "additional properties 'scop' not allowed" in typo.stdout + typo.stderr
    wrong = helm("template", "x", str(CHART), "--set", "rbac.scope=everywhere", check=False)
    assert wrong.returncode != 0 and "rbac" in wrong.stderr


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {
        (g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }


def _check_least_privilege(role: dict[str, Any]) -> None:
    verbs = _rules(role)
    assert "*" not in {v for vs in verbs.values() for v in vs}
    assert not any(r in ("pods/exec", "nodes") for _, r in verbs), "nothing the operator does not use"
    # The credentials Secret per LLMService: created once and read back; never listed, watched or changed.
    assert verbs[("", "secrets")] == {"get", "create"}
    assert verbs[("networking.k8s.io", "networkpolicies")] == {"get", "create", "patch", "delete"}
    assert verbs[("plimsoll.dev", "llmservices/status")] == {"get", "patch", "update"}
    assert "delete" not in verbs[("plimsoll.dev", "llmservices")], "the operator never deletes what users own"


def test_default_render_is_namespaced_to_the_release_namespace() -> None:
    """No cluster-wide access by default: one Role and RoleBinding, in the release's namespace, which the
    operator watches alone."""
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Role", "RoleBinding", "ServiceAccount"]
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "plimsoll-system"
    _check_least_privilege(role)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["plimsoll"] and container["args"][0] == "operator"
    assert "--namespace=plimsoll-system" in container["args"]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "plimsoll"
    env = {e["name"]: e for e in container["env"]}
    assert env["PLIMSOLL_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    labels = json.loads(env["PLIMSOLL_OPERATOR_POD_LABELS"]["value"])
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_cluster_scope_is_one_least_privilege_cluster_role() -> None:
    docs = render("rbac.scope=cluster")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "ServiceAccount"]
    _check_least_privilege(next(d for d in docs if d["kind"] == "ClusterRole"))
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--namespace")], "cluster scope watches every namespace"


def test_namespaced_render_has_roles_only_in_watched_namespaces() -> None:
    docs = render("rbac.scope=namespaced", "watchNamespaces={team-a,team-b}")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


@pytest.mark.k8s
def test_install_upgrade_uninstall(devcluster: Any) -> None:
    ns, release = "chart-lifecycle", "lifecycle-plimsoll"
    common = ["--namespace", ns, "--set-string", "podAnnotations.plimsoll\\.dev/run-locally=false"]
    devcluster.helm(
        "install", release, str(CHART), "--create-namespace", *common, "--wait", "--timeout", "120s"
    )
    try:
        deployment = json.loads(devcluster.kubectl("get", "deploy", release, "-n", ns, "-o", "json").stdout)
        assert deployment["status"].get("readyReplicas") == 1
        crd = json.loads(devcluster.kubectl("get", "crd", "llmservices.plimsoll.dev", "-o", "json").stdout)
        assert crd["spec"]["names"]["shortNames"] == ["llms"]
        devcluster.helm(
            "upgrade",
            release,
            str(CHART),
            *common,
            "--set",
            "operator.resyncSeconds=60",
            "--wait",
            "--timeout",
            "120s",
        )
        env = json.loads(devcluster.kubectl("get", "deploy", release, "-n", ns, "-o", "json").stdout)["spec"][
            "template"
        ]["spec"]["containers"][0]["env"]
        assert {"name": "PLIMSOLL_RESYNC_SECONDS", "value": "60"} in env
        history = devcluster.helm("history", release, "-n", ns, "-o", "json").stdout
        assert [h["revision"] for h in json.loads(history)] == [1, 2]
    finally:
        devcluster.helm("uninstall", release, "-n", ns, "--wait", "--timeout", "120s")
    left = devcluster.kubectl(
        "get",
        "deploy,sa,clusterrole,clusterrolebinding",
        "-A",
        "-l",
        f"app.kubernetes.io/instance={release}",
        "-o",
        "name",
    )
    assert left.stdout.strip() == ""
    devcluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- golden renders ------------------------------------------------------------------------

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
GOLDEN_CHART = Path(__file__).parent / "golden" / "chart"


def _golden_text(values: Path) -> str:
    """`helm template` with one values file, as sorted YAML; the dashboard JSON (tested on its
    own in test_monitoring_dashboard) is kept as its digest so dashboard edits do not churn here."""
    out = helm("template", "plimsoll", str(CHART), "--namespace", "plimsoll-system", "-f", str(values)).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-dashboard"):
            doc["data"] = {
                k: "sha256:" + hashlib.sha256(v.encode()).hexdigest() for k, v in doc["data"].items()
            }
    return yaml.safe_dump_all(docs, sort_keys=True, width=120)


@pytest.mark.parametrize("values", CI_VALUES, ids=[v.name for v in CI_VALUES])
def test_render_matches_golden(values: Path) -> None:
    """Regenerate after an intended change with PLIMSOLL_UPDATE_GOLDEN=1 and review the diff."""
    helm("lint", "--strict", str(CHART), "-f", str(values))
    text = _golden_text(values)
    path = GOLDEN_CHART / values.name.replace("-values.yaml", ".yaml")
    if os.environ.get("PLIMSOLL_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with PLIMSOLL_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), (
        f"{values.name}: the chart renders differently; review, then PLIMSOLL_UPDATE_GOLDEN=1"
    )


def test_platform_values_reach_the_pod() -> None:
    docs = [d for d in yaml.safe_load_all(_golden_text(CHART / "ci" / "platform-values.yaml")) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert by_kind["Deployment"]["metadata"]["name"] == "platform-llm-operator"
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsUser"] == 65532
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"} in container["env"]
    assert container["args"][-2:] == ["--metrics-bind-address=0.0.0.0:8081", "--verbose"]
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    monitor = by_kind["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = by_kind["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"] == by_kind["Deployment"]["spec"]["selector"]["matchLabels"]
    assert (
        by_kind["Deployment"]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "llm-operator"
    )


def test_service_monitor_needs_metrics() -> None:
    proc = helm("template", "x", str(CHART), "--set", "metrics.serviceMonitor.enabled=true", check=False)
    assert proc.returncode != 0 and "needs metrics.enabled" in proc.stderr


def test_readme_is_shown_and_names_every_top_level_value() -> None:
    readme = helm("show", "readme", str(CHART)).stdout
    assert "never upgrades" in readme, "the crds/ upgrade caveat"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [key for key in values if f"`{key}" not in readme]
    assert not missing, f"values not documented in charts/plimsoll/README.md: {missing}"
