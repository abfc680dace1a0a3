"""Plain numeric and text options for the scripts in ``benchmarks/``.

What it is: :func:`add_options`, one ``--name`` option per keyword default, typed by that
default (with its help text when given as a ``(default, help)`` pair), so a script states its
knobs as one call instead of a run of ``add_argument`` lines.
What it is not: the ``plimsoll bench`` command line (``cli.py`` and ``cli_flags.py``), and no
place for options with choices or actions (flags, repeated values): those stay ``add_argument`` calls.
"""

from __future__ import annotations

import argparse

Value = int | float | str


def add_options(parser: argparse.ArgumentParser, **defaults: Value | tuple[Value, str]) -> None:
    """Add ``--some-name`` for each ``some_name=default`` (or ``some_name=(default, help)``): an int,
    float or str option with that default."""
    for name, given in defaults.items():
        default, help_text = given if isinstance(given, tuple) else (given, None)
        if isinstance(default, bool):  # type=bool would read "False" as True
            raise TypeError(f"--{name}: a flag needs action='store_true', not add_options")
        parser.add_argument(
            "--" + name.replace("_", "-"), type=type(default), default=default, help=help_text
        )
