"""Labels every child of an LLMService carries, and the selector its replicas share. Pure."""

from plimsoll.operator.api.llmservice import LLMService

LLMSERVICE_LABEL = "plimsoll.dev/llmservice"
MANAGED_BY = "plimsoll-operator"


def selector_labels(svc: LLMService, component: str = "replica") -> dict[str, str]:
    """Labels that select the replicas (immutable once a Deployment exists: keep them few)."""
    return {
        "app.kubernetes.io/instance": svc.name,
        "app.kubernetes.io/component": component,
        LLMSERVICE_LABEL: svc.name,
    }


def common_labels(svc: LLMService, component: str = "replica") -> dict[str, str]:
    """Recommended app.kubernetes.io/* labels plus the selector labels."""
    return {
        "app.kubernetes.io/name": "llmservice",
        "app.kubernetes.io/part-of": "plimsoll",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(svc, component),
    }


def selector_string(svc: LLMService) -> str:
    """The replicas' selector as the scale subresource publishes it (``status.selector``)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(svc).items()))
