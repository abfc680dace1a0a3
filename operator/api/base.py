"""Shared pieces of the LLMService API models: the camelCase base model and schema helpers.

This module is not the schema itself (see ``spec`` and ``status``) and does no I/O.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel
from pydantic.types import JsonValue

GROUP = "plimsoll.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMService"
PLURAL = "llmservices"
SINGULAR = "llmservice"
SHORT_NAMES = ("llms",)


class APIModel(BaseModel):
    """Base for every CRD model: camelCase names in YAML, snake_case in Python.

    Unknown keys are ignored rather than refused: the API server prunes fields the
    CRD does not know, and an operator one version behind must still read objects
    written against a newer CRD.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=False,
    )

    def to_api(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def camel_fields(obj: Any, *names: str) -> dict[str, Any]:
    """A dataclass's fields (all, or ``names``) as a status block: camelCase keys, as :class:`APIModel` writes."""
    keys = names or tuple(f.name for f in dataclasses.fields(obj))
    return {to_camel(name): getattr(obj, name) for name in keys}


def camel_values(cls: Any, block: Mapping[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`camel_fields`: each field of dataclass ``cls`` from its camelCase key (None if absent)."""
    return {f.name: block.get(to_camel(f.name)) for f in dataclasses.fields(cls)}


def defaulted(model: type[BaseModel], description: str) -> Any:
    """The field of a nested block that, left out, is there with its own defaults (validated from ``{}``)."""
    return Field(default_factory=lambda: model.model_validate({}), description=description)


# A Kubernetes resource quantity ("4", 4, "16Gi", "500m"). Checked in Python by the
# API server's grammar, and in the CRD by CEL's isQuantity(), so a typo fails at
# `kubectl apply` instead of when the Deployment is written.
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write e.g. 4, 500m, 16Gi or 8G")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int || isQuantity(self)",
                    "message": "must be a Kubernetes quantity such as 4, 500m or 16Gi",
                }
            ],
        }
    ),
]

# A free-form Kubernetes sub-object (an affinity, a toleration, an env valueFrom)
# that plimsoll passes through to the pod unchanged; the API server validates it
# when the Deployment is written.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    """One CEL ``x-kubernetes-validations`` entry; the API server shows ``message`` on failure."""
    entry: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry
