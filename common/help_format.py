"""`--help` shows no value placeholder for on/off flags.

What it is: one patch to typer's rich help: typer (0.2x) labels every option with
its type, so ``--enable-prefix-caching/--no-enable-prefix-caching`` and ``--help``
read ``<bool>`` as if they took a value. A flag takes none; show nothing.
What it is not: any other change to typer's help layout.
"""

from __future__ import annotations

from typing import Any

from typer import core


def hide_flag_types() -> None:
    option = getattr(core, "TyperOption", None)
    original = getattr(option, "display_type_rich", None)
    if option is None or original is None or getattr(original, "_plimsoll_flags", False):
        return  # another typer layout, or already patched

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False):
            return None
        return original(self, ctx)  # type: ignore[no-any-return]

    display_type_rich._plimsoll_flags = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich
