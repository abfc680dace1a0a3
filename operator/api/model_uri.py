"""Where a model's weights come from: the ``model.uri`` grammar and its parsed form.

Four schemes: ``pvc://claim/path`` (a PersistentVolumeClaim in the LLMService's
namespace), ``hf://org/name[@revision]`` (a Hugging Face repository, fetched by
``plimsoll fetch`` in an init container before the engine starts; the revision is a
branch, tag or commit, default ``main``),
``file:///path`` (a path baked into the image) and ``embedded://smollm2-135m``
(the model shipped inside the plimsoll image). This module parses; it does not
mount volumes or fetch anything (that is ``resources.deployment``). LoRA adapters
(``spec.adapters``) take the same forms except ``embedded://``.
"""

import re
from dataclasses import dataclass
from typing import Literal

EMBEDDED_MODELS = ("smollm2-135m",)

# Kept in one regular expression so the CRD (OpenAPI `pattern`) and Python agree.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_HF_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
# A branch, tag or commit hash; slashes for refs such as refs/pr/1.
_HF_REVISION = r"[A-Za-z0-9][A-Za-z0-9._/-]*"
MODEL_URI_PATTERN = (
    rf"^(pvc://{_DNS_LABEL}(/[^/].*)?"
    rf"|hf://{_HF_PART}/{_HF_PART}(@{_HF_REVISION})?"
    r"|file:///.+"
    rf"|embedded://({'|'.join(EMBEDDED_MODELS)}))$"
)
_MODEL_URI = re.compile(MODEL_URI_PATTERN)
# A LoRA adapter comes from the same places, except the image's embedded models.
ADAPTER_URI_PATTERN = (
    rf"^(pvc://{_DNS_LABEL}(/[^/].*)?"
    rf"|hf://{_HF_PART}/{_HF_PART}(@{_HF_REVISION})?"
    r"|file:///.+)$"
)
_ADAPTER_URI = re.compile(ADAPTER_URI_PATTERN)

Scheme = Literal["pvc", "hf", "file", "embedded"]


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """A parsed ``model.uri``.

    ``name`` is the claim (pvc), the repository id (hf), the absolute path (file) or
    the embedded model's name; ``path`` is the sub-path inside a claim ("" for its root);
    ``revision`` is the hf:// branch, tag or commit ("main" when the URI names none).
    """

    scheme: Scheme
    name: str
    path: str = ""
    revision: str = ""


def parse_model_uri(uri: str) -> ModelLocation:
    """Parse a model URI, or raise ValueError saying which forms are accepted."""
    if not _MODEL_URI.match(uri):
        raise ValueError(
            f"model.uri {uri!r} is not one of pvc://<claim>[/path], hf://<org>/<name>[@revision], "
            f"file:///<absolute path> or embedded://<{'|'.join(EMBEDDED_MODELS)}>"
        )
    return _parse(uri)


def parse_adapter_uri(uri: str) -> ModelLocation:
    """Parse an adapter URI (pvc://, hf:// or file://), or raise ValueError saying which forms are accepted."""
    if not _ADAPTER_URI.match(uri):
        raise ValueError(
            f"adapter uri {uri!r} is not one of pvc://<claim>[/path], hf://<org>/<name>[@revision] "
            "or file:///<absolute path>"
        )
    return _parse(uri)


def _parse(uri: str) -> ModelLocation:
    scheme, rest = uri.split("://", 1)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return ModelLocation("pvc", claim, path.rstrip("/"))
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        return ModelLocation("hf", repo, revision=revision or "main")
    if scheme == "file":
        return ModelLocation("file", rest)
    return ModelLocation("embedded", rest)
