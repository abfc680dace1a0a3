"""Nothing but ``handlers/replica_writer.py`` writes a replica count: the source searched for every patch shape.

The shapes that can move ``spec.replicas`` of an LLMService (or any scale
target): a merge patch whose ``spec`` holds only ``replicas``, a JSON patch on
``/spec/replicas``, a call on a ``/scale`` subresource (REST path or a client's
``*_scale`` method), and ``kubectl scale``. Every Python file of the
distribution (``common/``, ``operator/``, ``router/``, ``bench/``,
``devcluster/``, ``runtime/``) is searched; the writer itself must match, so the
search cannot pass by finding nothing. Built manifests (a Deployment's
``spec.replicas`` beside its selector and template) follow the LLMService's
count and are not patches. ``lint-imports`` holds the other half: only
``replica_planning.py`` imports the writer.
"""

import re
from pathlib import Path

import pytest

from plimsoll.operator.handlers.replica_writer import replicas_patch
from plimsoll.operator.scaling.pools import PREFILL_POOL
from plimsoll.operator.scaling.replica_plan import DEFAULT_POOL

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("common", "operator", "router", "bench", "devcluster", "runtime")
WRITER = Path("operator/handlers/replica_writer.py")

PATCH_SHAPES = {
    "merge patch of spec.replicas alone": re.compile(
        r"""["']spec["']\s*:\s*\{\s*["']replicas["']\s*:\s*[^,{}]+\}"""
    ),
    # A split service's prefill pool: spec.disaggregation.prefill.replicas.
    "merge patch of a pool's replicas": re.compile(
        r"""["']prefill["']\s*:\s*\{\s*["']replicas["']\s*:\s*[^,{}]+\}"""
    ),
    "JSON patch of /spec/replicas": re.compile(r"/spec/replicas"),
    "the /scale subresource": re.compile(r"""["'][^"'\n]*/scale["'/]"""),
    "a client's scale call": re.compile(r"\w+_scale\s*\("),
    "kubectl scale": re.compile(r"""["']scale["']\s*,"""),
}


def sources() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def test_only_the_replica_writer_patches_replicas() -> None:
    found: dict[Path, list[str]] = {}
    for path in sources():
        text = path.read_text()
        shapes = [name for name, pattern in PATCH_SHAPES.items() if pattern.search(text)]
        if shapes:
            found[path.relative_to(ROOT)] = shapes
    assert WRITER in found, "the search no longer finds the writer's own patch: update PATCH_SHAPES"
    assert found == {WRITER: ["merge patch of spec.replicas alone", "merge patch of a pool's replicas"]}, found


IMPORTS_WRITER = re.compile(
    r"^\s*(from|import)\s+plimsoll\.operator\.handlers(\.replica_writer| import .*replica_writer)",
    re.MULTILINE,
)


def test_only_the_replica_planning_handler_imports_the_writer() -> None:
    importers = {str(p.relative_to(ROOT)) for p in sources() if IMPORTS_WRITER.search(p.read_text())}
    assert importers == {"operator/handlers/replica_planning.py"}, importers


def test_the_shapes_catch_what_they_are_for() -> None:
    """Each pattern matches the writes it names and not a built manifest."""
    written = {
        "merge patch of spec.replicas alone": 'kube.merge_patch(API_VERSION, KIND, ns, name, {"spec": {"replicas": 3}})',
        "merge patch of a pool's replicas": '{"spec": {"disaggregation": {"prefill": {"replicas": n}}}}',
        "JSON patch of /spec/replicas": '[{"op": "replace", "path": "/spec/replicas", "value": 2}]',
        "the /scale subresource": 'object_path(API_VERSION, KIND, ns, name) + "/scale"',
        "a client's scale call": "api.patch_namespaced_custom_object_scale(group, version, ns, plural, name, body)",
        "kubectl scale": 'cluster.kubectl("scale", "llms", name, "--replicas=2")',
    }
    for name, line in written.items():
        assert PATCH_SHAPES[name].search(line), name
    built = '"spec": {"replicas": spec.desired_replicas(), "selector": {"matchLabels": labels}}'
    assert not any(p.search(built) for p in PATCH_SHAPES.values())


def test_the_writer_puts_each_pools_count_where_the_spec_holds_it() -> None:
    assert replicas_patch(PREFILL_POOL, 3) == {"spec": {"disaggregation": {"prefill": {"replicas": 3}}}}
    assert replicas_patch(DEFAULT_POOL, 2) == {"spec": {"replicas": 2}}
    with pytest.raises(ValueError, match="no replica pool 'extra'"):
        replicas_patch("extra", 1)
