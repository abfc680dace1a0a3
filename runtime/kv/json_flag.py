"""Reads a KV flag given as JSON text (vLLM's ``--kv-events-config``, ``--kv-transfer-config``).

What it is: the one place that turns the flag's text into an object and says how to write it
when the text is not JSON. What it is not: validation of the fields (each config's pydantic
model does that).
"""

from __future__ import annotations

import json


def json_flag(value: object, flag: str, example: str) -> object:
    """``value`` parsed from JSON when it is text, else as given; a ValueError naming ``flag``
    and a working ``example`` when the text is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{flag} must be a JSON object such as '{example}' ({exc})") from None
