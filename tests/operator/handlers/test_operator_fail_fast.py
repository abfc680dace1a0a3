"""`plimsoll operator` with no cluster fails in one line with a hint, not a kopf retry loop."""

import socket
from pathlib import Path

from typer.testing import CliRunner

from plimsoll.cli import app

HINT = "start a local one with `plimsoll dev up` and export the KUBECONFIG it prints, or set KUBECONFIG"


def run(env: dict[str, str]) -> str:
    result = CliRunner().invoke(app, ["operator"], env={"KUBERNETES_SERVICE_HOST": "", **env})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    return lines[0]


def test_no_kubeconfig(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert run({"KUBECONFIG": str(missing)}) == (
        f"plimsoll operator: no Kubernetes cluster configured (no kubeconfig at {missing}); {HINT}"
    )


def test_unreachable_cluster(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "kubeconfig"
    conf.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: dev\n"
        f"clusters: [{{name: dev, cluster: {{server: 'https://127.0.0.1:{port}'}}}}]\n"
        "contexts: [{name: dev, context: {cluster: dev, user: dev}}]\nusers: [{name: dev, user: {}}]\n"
    )
    line = run({"KUBECONFIG": str(conf)})
    assert line.startswith(
        f"plimsoll operator: the cluster at https://127.0.0.1:{port} (kubeconfig {conf}) is not reachable"
    )
    assert line.endswith(HINT)
