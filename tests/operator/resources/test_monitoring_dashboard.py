"""The chart's Grafana dashboard: six panels, queries that parse, series the runtime really exports.

The metric check runs the real server (tiny random model, CPU) and compares every
``plimsoll_*`` series a panel queries with what ``/metrics`` exposes; ``vllm:*``
names are held to plimsoll.metric_names' vLLM table, the contract the autoscaler
also reads. Rendering goes through the real ``helm template``.
"""

import json
import re
import runpy
import subprocess
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from plimsoll import metric_names as mn
from plimsoll.devcluster import paths
from plimsoll.operator.resources.monitoring import SERIES_LABEL

CHART = Path(__file__).resolve().parents[3] / "charts" / "plimsoll"
DASHBOARD = CHART / "dashboards" / "llmservice.json"
GENERATOR = CHART / "dashboards" / "generate.py"
SIX_PANELS = [
    "GPU utilisation and memory",
    "Request and token throughput",
    "TTFT and TPOT percentiles",
    "Queue length",
    "KV-cache usage",
    "Timeouts and errors",
]
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$namespace": "team-a",
    "$llmservice": "chat|code",
    "${datasource}": "prom",
    "$priority": "0|1",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def substitute(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query, f"a Grafana variable the test does not know in {query}"
    return query


def panel_queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def variable_selectors() -> list[str]:
    """The series selector inside each `label_values(<selector>, label)` variable query."""
    selectors = []
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        assert match, variable
        assert match.group(2) in ("namespace", SERIES_LABEL, "priority")
        selectors.append(match.group(1))
    return selectors


def metric_names(query: str) -> set[str]:
    """Every metric name a query selects, from the parsed AST (raises on a syntax error)."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.update(matcher.value.split("|"))

    promql_parser.walk(promql_parser.parse(substitute(query)), visit)
    return names


def referenced_names() -> set[str]:
    return {n for q in [*panel_queries(), *variable_selectors()] for n in metric_names(q)}


def test_committed_json_is_what_the_generator_writes() -> None:
    generated = runpy.run_path(str(GENERATOR))["render"]()
    assert DASHBOARD.read_text() == generated, (
        "dashboards/llmservice.json drifted from generate.py: run "
        "`python charts/plimsoll/dashboards/generate.py` and commit both"
    )


def test_six_panels_a_priority_class_panel_and_the_filter_variables() -> None:
    board = dashboard()
    assert [p["title"] for p in board["panels"]] == [
        *SIX_PANELS, "SLO attainment and cost", "Prefix-cache hit rate per KV tier", "Priority class $priority",
    ]  # fmt: skip
    assert board["panels"][-1]["repeat"] == "priority"  # Grafana draws one per priority class
    for p in board["panels"]:
        assert p["targets"] and p["description"], p["title"]
        assert {t["refId"] for t in p["targets"]} == {chr(ord("A") + i) for i in range(len(p["targets"]))}
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", SERIES_LABEL, "priority"]
    # No two panels overlap on the grid.
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in board["panels"]]
    assert len(set(cells)) == len(cells)


def selectors_of(query: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(substitute(query)), visit)
    return found


def test_every_query_parses_and_filters_by_namespace_and_llmservice() -> None:
    for query in panel_queries():
        for selector in selectors_of(query):
            if selector.name and selector.name.startswith("DCGM_"):
                continue  # joined to the LLMService's pods through `up{…}`
            labels = {m.name: m.value for m in selector.matchers.matchers}
            assert labels.get("namespace") == "team-a", (selector, query)
            assert labels.get(SERIES_LABEL) == "chat|code", (selector, query)
    for selector in variable_selectors():
        metric_names(selector)


def test_a_broken_query_would_fail_the_parse() -> None:
    with pytest.raises(ValueError, match="parenthesis"):
        metric_names('sum(rate(plimsoll_num_requests_running{namespace="$namespace"}[$__rate_interval])')


def test_gpu_panel_reads_dcgm() -> None:
    gpu = {n for n in referenced_names() if n.startswith("DCGM_")}
    assert gpu == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"}


def _strip_histogram(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_vllm_names_are_the_vllm_table_and_pair_with_plimsoll() -> None:
    names = referenced_names()
    vllm = {_strip_histogram(n) for n in names if n.startswith("vllm:")}
    table = {getattr(mn.VLLM, f) for f in mn.VLLM.__dataclass_fields__}
    assert vllm and vllm <= table, vllm - table
    # Every vLLM series has its plimsoll twin in the same query set, so both engines draw every panel.
    twins = {getattr(mn.PLIMSOLL, f) for f in mn.VLLM.__dataclass_fields__ if getattr(mn.VLLM, f) in vllm}
    assert twins <= {_strip_histogram(n) for n in names}


@pytest.mark.slow
def test_every_plimsoll_series_is_exported_by_the_runtime(tmp_path: Path) -> None:
    from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    with ThreadedServer(model) as server:
        exposition = httpx.get(f"{server.url}/metrics").text
    # A labelled counter has no sample until its first increment (no preemption yet on an
    # idle server), so compare with the declared families and the series each one yields.
    exported = set()
    for family in text_string_to_metric_families(exposition):
        suffixes = {"counter": ("_total",), "histogram": HISTOGRAM_SUFFIXES}.get(family.type, ("",))
        exported |= {family.name + suffix for suffix in suffixes}
    # plimsoll_operator_* come from the operator's endpoint, not the replicas.
    operator = "plimsoll_operator_"
    wanted = {n for n in referenced_names() if n.startswith(mn.PREFIX) and not n.startswith(operator)}
    assert len(wanted) >= 10, wanted
    missing = wanted - exported
    assert not missing, f"the dashboard queries series the runtime does not export: {sorted(missing)}"


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    binary = paths.binary("helm")
    assert binary.exists(), f"{binary} missing; build it with `bash devcluster/build.sh`"
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)


def _render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "plimsoll", str(CHART), "--namespace", "plimsoll-system"]
    for s in sets:
        args += ["--set", s]
    proc = _helm(*args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_helm_renders_the_dashboard_configmap_for_the_grafana_sidecar() -> None:
    [configmap] = [d for d in _render() if d["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "plimsoll-system"
    [(key, text)] = configmap["data"].items()
    assert key.endswith(".json")
    assert json.loads(text) == dashboard()


def test_dashboard_toggle_namespace_and_labels() -> None:
    assert not [d for d in _render("dashboards.enabled=false") if d["kind"] == "ConfigMap"]
    [configmap] = [
        d
        for d in _render("dashboards.namespace=monitoring", "dashboards.annotations.grafana_folder=LLM")
        if d["kind"] == "ConfigMap"
    ]
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    typo = _helm("template", "x", str(CHART), "--set", "dashboards.enable=true")
    assert typo.returncode != 0 and "enable" in typo.stderr


def test_operator_series_on_the_dashboard_are_the_ones_the_operator_exports() -> None:
    from plimsoll.operator.handlers.attainment import COST_PER_1K_GOOD, SLO_ATTAINMENT

    drawn = {n for n in referenced_names() if n.startswith("plimsoll_operator_")}
    assert drawn == {SLO_ATTAINMENT._name, COST_PER_1K_GOOD._name}
