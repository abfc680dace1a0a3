"""The Helm chart: strict lint, schema, rendered RBAC; install/upgrade/uninstall on the local control plane."""

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.devcluster import paths

CHART = Path(__file__).resolve().parents[2] / "charts" / "plimsoll"


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


def test_namespaced_scope_needs_namespaces() -> None:
    proc = helm("template", "x", str(CHART), "--set", "rbac.scope=namespaced", check=False)
    assert proc.returncode != 0
    assert "needs watchNamespaces" in proc.stderr


def test_default_render_is_cluster_scoped_least_privilege() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "ServiceAccount"]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert "*" not in {v for vs in verbs.values() for v in vs}
    assert not any(r in ("secrets", "pods/exec", "nodes") for _, r in verbs), (
        "nothing the operator does not use"
    )
    assert verbs[("plimsoll.dev", "llmservices/status")] == {"get", "patch", "update"}
    assert "delete" not in verbs[("plimsoll.dev", "llmservices")], "the operator never deletes what users own"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["plimsoll"] and container["args"][0] == "operator"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "plimsoll"


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
