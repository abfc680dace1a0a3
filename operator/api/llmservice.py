"""The whole LLMService object (metadata, spec, status) as the operator reads it. No I/O."""

from typing import Any

from pydantic import Field, model_validator

from plimsoll.operator.api.base import API_VERSION, KIND, APIModel
from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.status import LLMServiceStatus


class ObjectMeta(APIModel):
    """The metadata fields the operator uses."""

    name: str
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class LLMService(APIModel):
    """An LLMService as stored by the API server."""

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: ObjectMeta
    spec: LLMServiceSpec
    status: LLMServiceStatus = Field(default_factory=lambda: LLMServiceStatus.model_validate({}))

    @model_validator(mode="after")
    def _adapters_apart_from_base(self) -> "LLMService":
        if any(a.name == self.served_name for a in self.spec.adapters):
            raise ValueError(
                f"adapters: {self.served_name!r} is the base model's served name; give the adapter another name"
            )
        return self

    @classmethod
    def from_body(cls, body: Any) -> "LLMService":
        """Validate an object body (a dict or kopf's Body); raises pydantic.ValidationError."""
        return cls.model_validate(
            {
                "apiVersion": body.get("apiVersion", API_VERSION),
                "kind": body.get("kind", KIND),
                "metadata": dict(body.get("metadata", {})),
                "spec": dict(body.get("spec", {})),
                "status": {},
            }
        )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def served_name(self) -> str:
        """The model name clients send: spec.model.servedName, else the LLMService name."""
        return self.spec.model.served_name or self.metadata.name
