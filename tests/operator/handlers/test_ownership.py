"""The one ownership rule: an object is this LLMService's only through an ownerReference with its uid."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.ownership import conflict_message, has_conflict, owned_by

BODY = {
    "apiVersion": "plimsoll.dev/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": "web", "namespace": "ns", "uid": "u-1"},
    "spec": {"model": {"uri": "embedded://smollm2-135m"}},
}


def obj(*uids: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    refs = [{"apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService", "name": "web", "uid": u} for u in uids]
    return {"kind": "Service", "metadata": {"name": "web", "ownerReferences": refs, "labels": labels or {}}}


def test_ownership_is_by_uid_never_by_name_or_labels() -> None:
    svc = LLMService.from_body(BODY)
    for owner in (BODY, svc):
        assert owned_by(obj("u-1"), owner)
        assert owned_by(obj("other", "u-1"), owner)
        assert not owned_by(obj(), owner)
        # Same name, another (earlier, deleted) LLMService of that name, or copied labels: not ours.
        assert not owned_by(obj("u-0", labels={"app.kubernetes.io/managed-by": "plimsoll-operator"}), owner)
    assert not owned_by(obj("u-1"), {"metadata": {"name": "web"}}), "no uid (a preview): owns nothing"


def test_the_conflict_names_every_object_once() -> None:
    message = conflict_message(["Service web", "Deployment web", "Service web"])
    assert message.startswith("Deployment web, Service web already exist") and "untouched" in message
    assert has_conflict({"status": {"conditions": [{"type": "OwnershipConflict", "status": "True"}]}})
    assert not has_conflict({"status": {"conditions": [{"type": "OwnershipConflict", "status": "False"}]}})
    assert not has_conflict({})
