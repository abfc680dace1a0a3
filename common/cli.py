"""The `plimsoll` command line: one entry point, one sub-command per part.

Each part owns its sub-commands in its own ``cli`` module. The top level imports none of
them: a sub-command's module is imported when that sub-command is looked up, so
`plimsoll serve` pays for the server's imports only, not for the bench, planner,
operator or control-plane modules (and their rich/httpx/kubernetes imports). Command
bodies still import heavy dependencies (torch, kopf) inside themselves.

What it is not: a plugin system; the table below is the whole list of sub-commands.
"""

import importlib
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from plimsoll import __version__
from plimsoll.help_format import hide_flag_types, keep_option_names_whole_when_help_prints

# name -> (module, attribute, one-line help). An attribute that is a Typer is a group of
# sub-commands (`plimsoll bench run`); any other is a command function. Listed in `--help` order
# (typer's: commands, then groups).
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("plimsoll.runtime.cli", "serve", "Run the inference server (OpenAI-compatible API, /metrics)."),
    "diagnose": (
        "plimsoll.bench.cli",
        "diagnose",
        "Read a server's metrics and name the layer that limits it.",
    ),
    "fetch": (
        "plimsoll.model_fetch",
        "fetch_command",
        "Download a Hugging Face model before an engine starts (hf://org/name[@rev]).",
    ),
    "plan": ("plimsoll.plan", "plan", "Offline capacity planning from a model config and GPU memory."),
    "plan-variants": (
        "plimsoll.plan_variants",
        "plan_variants",
        "The cheapest mix of hardware variants for a demand, from one bench report each.",
    ),
    "profile": (
        "plimsoll.profile_fetch",
        "profile_command",
        "Take a profile of a running replica (torch trace or py-spy flame graph).",
    ),
    "route": ("plimsoll.router.cli", "route", "Run the queue-aware, prefix-affine router."),
    "operator": ("plimsoll.operator.cli", "run_operator", "Run the LLMService operator (kopf)."),
    "demo": ("plimsoll.demo", "demo", "Bring up everything locally and show an LLMService serving."),
    "bench": ("plimsoll.bench.cli", "app", "Load-test a server and find its saturation knees."),
    "dev": ("plimsoll.devcluster.cli", "app", "Local Kubernetes control plane with simulated GPU nodes."),
}


def load_subcommand(name: str) -> Any:
    """Import one sub-command's module and build its click command, as ``app.command``/``add_typer`` would."""
    module, attribute, help_text = SUBCOMMANDS[name]
    target: Any = getattr(importlib.import_module(module), attribute)
    holder = typer.Typer()
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name, help=help_text)
    else:
        holder.command(name, help=help_text)(target)
    return typer.main.get_group(holder).commands[name]


class LazyCommands(dict[str, Any]):
    """A group's name -> command table that builds a sub-command of :data:`SUBCOMMANDS` when first asked."""

    def __missing__(self, name: str) -> Any:
        if name not in SUBCOMMANDS:
            raise KeyError(name)
        command = self[name] = load_subcommand(name)
        return command


class LazyGroup(TyperGroup):
    """The root group: sub-commands come from :data:`SUBCOMMANDS`, each imported on first lookup."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = LazyCommands(self.commands)

    def list_commands(self, ctx: Any) -> list[str]:
        return [*(name for name in super().list_commands(ctx) if name not in SUBCOMMANDS), *SUBCOMMANDS]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        try:
            return self.commands[cmd_name]
        except KeyError:
            return None


hide_flag_types()
keep_option_names_whole_when_help_prints()
app = typer.Typer(
    name="plimsoll",
    cls=LazyGroup,
    help="Serve LLMs on Kubernetes below their saturation line.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"plimsoll {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Serve LLMs on Kubernetes below their saturation line."""


def main() -> None:
    from plimsoll.runtime.serve_args import expand_multi_value_flags

    sys.argv[1:] = expand_multi_value_flags(sys.argv[1:])  # vLLM's --lora-modules a=p b=q
    app()
