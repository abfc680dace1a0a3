"""`--help` that a user can read and copy from at any terminal width.

What it is: two patches to typer's rich help (typer 0.2x):

- on/off flags show no value placeholder: typer labels every option with its type,
  so ``--enable-prefix-caching/--no-enable-prefix-caching`` and ``--help`` read
  ``<bool>`` as if they took a value. A flag takes none; show nothing.
- option names are never cut: typer's options table gives the names, their
  ``--no-…`` forms and the type four columns that rich shrinks with an ellipsis
  when the terminal is narrow (``--verify-secon…`` at 80 columns). Here the names
  and their negative forms share one column that never wraps or truncates (rich
  sizes it to the longest name), the type sits under them, and only the
  description wraps into what is left.

What it is not: any other change to typer's layout (usage line, command lists,
panels and styles stay typer's).
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


def _option_names(param: Any, ctx: Any, rich_utils: Any) -> Any:
    """``--long, -s`` with ``--no-long`` on its own line, and the type after the names."""
    from rich.text import Text

    names = ", ".join(sorted(param.opts, key=lambda o: not o.startswith("--")))  # --long first, then -s
    if isinstance(param, core.TyperArgument):
        names = param.display_name_raw + ("..." if param.metavar is None and param.nargs != 1 else "")
    cell = rich_utils.highlighter(Text(names))
    negative = ", ".join(param.secondary_opts)
    if negative:
        cell.append("\n")
        cell.append(rich_utils.negative_highlighter(Text(negative)))
    kind = param.display_type_rich(ctx=ctx) if isinstance(param, core.TyperOption) else None
    range_str = param._get_number_range_help_str() if hasattr(param, "_get_number_range_help_str") else ""
    if kind or range_str:
        label = Text(f" {kind or ''}" + (rich_utils.RANGE_STRING.format(range_str) if range_str else ""))
        cell.append(rich_utils.types_highlighter(label))
    return cell


def keep_option_names_whole_when_help_prints() -> None:
    """:func:`keep_option_names_whole` on the first help a command or group prints, not at import:
    ``typer.rich_utils`` (rich's tables, tracebacks, markdown) costs a tenth of a second that a
    command run without ``--help`` (``plimsoll serve`` starting a replica) does not spend."""
    for cls in (core.TyperCommand, core.TyperGroup):
        original = cls.__dict__.get("format_help")
        if original is None or getattr(original, "_plimsoll_whole", False):
            continue

        def format_help(self: Any, ctx: Any, formatter: Any, _original: Any = original) -> None:
            keep_option_names_whole()
            _original(self, ctx, formatter)

        format_help._plimsoll_whole = True  # type: ignore[attr-defined]
        cls.format_help = format_help  # type: ignore[method-assign]


def keep_option_names_whole() -> None:
    from typer import rich_utils

    original = getattr(rich_utils, "_print_options_panel", None)
    if (
        original is None
        or getattr(original, "_plimsoll_whole", False)
        or not hasattr(rich_utils, "_get_parameter_help")
    ):
        return  # another typer layout, or already patched

    def print_options_panel(
        *, name: str, params: list[Any], ctx: Any, markup_mode: Any, console: Any
    ) -> None:
        from rich import box
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        if not params:
            return
        table = Table(
            highlight=True,
            show_header=False,
            expand=True,
            box=getattr(box, rich_utils.STYLE_OPTIONS_TABLE_BOX, None),
            show_lines=rich_utils.STYLE_OPTIONS_TABLE_SHOW_LINES,
            leading=rich_utils.STYLE_OPTIONS_TABLE_LEADING,
            pad_edge=rich_utils.STYLE_OPTIONS_TABLE_PAD_EDGE,
            padding=rich_utils.STYLE_OPTIONS_TABLE_PADDING,
        )
        required = any(p.required for p in params)
        if required:
            table.add_column(no_wrap=True)
        table.add_column(no_wrap=True, overflow="ignore")  # names: never wrapped, never cut
        table.add_column(ratio=1, overflow="fold")  # the description takes what is left and wraps
        for param in params:
            row: list[Any] = []
            if required:
                star = rich_utils.REQUIRED_SHORT_STRING if param.required else ""
                row.append(Text(star, style=rich_utils.STYLE_REQUIRED_SHORT))
            row.append(_option_names(param, ctx, rich_utils))
            help_cell = rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode)
            for part in getattr(help_cell, "renderables", []):
                if isinstance(part, Text):
                    part.overflow = "fold"  # a long URL or header name breaks across lines, never cut
            row.append(help_cell)
            table.add_row(*row)
        console.print(
            Panel(
                table,
                border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
                title=name,
                title_align=rich_utils.ALIGN_OPTIONS_PANEL,
            )
        )

    print_options_panel._plimsoll_whole = True  # type: ignore[attr-defined]
    rich_utils._print_options_panel = print_options_panel
