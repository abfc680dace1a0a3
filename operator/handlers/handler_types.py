"""Type aliases the handlers' signatures share: the logger they log to and the body they act on.

Names for types only; no behaviour lives here.
"""

import logging
from typing import Any, TypeAlias

import kopf

# kopf hands a handler a LoggerAdapter; the CLI's one-shot paths and the tests pass a plain Logger.
Log: TypeAlias = logging.Logger | logging.LoggerAdapter[Any]
# The LLMService as kopf delivers it, or the plain dict a re-read or a test passes.
BodyLike: TypeAlias = kopf.Body | dict[str, Any]
