"""The generated CRD: committed copies match the models, and the schema is structural."""

from pathlib import Path
from typing import Any

import yaml

from plimsoll.operator.api import crd

ROOT = Path(__file__).resolve().parents[3]


def test_committed_crds_match_the_models() -> None:
    expected = crd.render()
    for folder in crd.CRD_DIRS:
        path = ROOT / folder / crd.CRD_FILENAME
        assert path.exists(), f"{path} missing; run `python -m plimsoll.operator.api.crd`"
        assert path.read_text() == expected, f"{path} drifted; run `python -m plimsoll.operator.api.crd`"


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    assert crd.main(["--root", str(tmp_path), "--check"]) == 1
    assert crd.main(["--root", str(tmp_path)]) == 0
    assert crd.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / crd.CRD_DIRS[0] / crd.CRD_FILENAME).write_text("# edited by hand\n")
    assert crd.main(["--root", str(tmp_path), "--check"]) == 1


def _walk(node: Any, path: str = "") -> list[str]:
    """Violations of the structural-schema rules the API server enforces."""
    problems: list[str] = []
    if isinstance(node, dict):
        if "$ref" in node or "title" in node or "$defs" in node:
            problems.append(f"{path}: $ref/title/$defs")
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: anyOf outside int-or-string")
        if ("properties" in node or "items" in node or "enum" in node) and "type" not in node:
            problems.append(f"{path}: untyped node")
        for flag in ("exclusiveMinimum", "exclusiveMaximum"):
            if flag in node and not isinstance(node[flag], bool):
                problems.append(f"{path}: {flag} must be a boolean in OpenAPI v3.0")
        if node.get("type") == "null" or node.get("default", 0) is None:
            problems.append(f"{path}: null")
        for key, value in node.items():
            if key in ("properties",):
                for name, sub in value.items():
                    problems += _walk(sub, f"{path}.{name}")
            elif key in ("items", "additionalProperties"):
                problems += _walk(value, f"{path}[]")
    return problems


def test_schema_is_structural() -> None:
    schema = crd.openapi_schema()
    assert _walk(schema) == []


def test_crd_shape() -> None:
    doc = yaml.safe_load(crd.render())
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["llms"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready",
        "Replicas",
        "Capacity",
        "Age",
    ]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["engine"]["properties"]["kind"]["enum"] == ["plimsoll", "vllm", "sglang"]
    assert spec["properties"]["resources"]["properties"]["gpu"]["properties"]["count"]["minimum"] == 0
    rules = [v["rule"] for v in spec["properties"]["scaling"]["x-kubernetes-validations"]]
    assert "self.min <= self.max" in rules
    assert "pattern" in spec["properties"]["model"]["properties"]["uri"]
    assert version["schema"]["openAPIV3Schema"]["properties"]["status"][
        "x-kubernetes-preserve-unknown-fields"
    ]
