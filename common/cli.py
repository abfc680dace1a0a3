"""The `plimsoll` command line: one entry point, one sub-command per part.

Each part owns its sub-commands in its own ``cli`` module and imports heavy
dependencies (torch, kopf) inside the command body, so `plimsoll --help` and
`plimsoll bench ...` start fast.
"""

import sys

import typer

from plimsoll import __version__
from plimsoll.bench.cli import app as bench_app
from plimsoll.bench.cli import diagnose
from plimsoll.demo import demo
from plimsoll.devcluster.cli import app as dev_app
from plimsoll.help_format import hide_flag_types, keep_option_names_whole
from plimsoll.model_fetch import fetch_command
from plimsoll.operator.cli import run_operator
from plimsoll.plan import plan
from plimsoll.profile_fetch import profile_command
from plimsoll.router.cli import route
from plimsoll.runtime.cli import serve

hide_flag_types()
keep_option_names_whole()
app = typer.Typer(
    name="plimsoll",
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


app.command("serve", help="Run the inference server (OpenAI-compatible API, /metrics).")(serve)
app.add_typer(bench_app, name="bench", help="Load-test a server and find its saturation knees.")
app.command("diagnose", help="Read a server's metrics and name the layer that limits it.")(diagnose)
app.command("fetch", help="Download a Hugging Face model before an engine starts (hf://org/name[@rev]).")(
    fetch_command
)
app.command("plan", help="Offline capacity planning from a model config and GPU memory.")(plan)
app.command("profile", help="Take a profile of a running replica (torch trace or py-spy flame graph).")(
    profile_command
)
app.command("route", help="Run the queue-aware, prefix-affine router.")(route)
app.command("operator", help="Run the LLMService operator (kopf).")(run_operator)
app.add_typer(dev_app, name="dev", help="Local Kubernetes control plane with simulated GPU nodes.")
app.command("demo", help="Bring up everything locally and show an LLMService serving.")(demo)


def main() -> None:
    from plimsoll.runtime.serve_args import expand_multi_value_flags

    sys.argv[1:] = expand_multi_value_flags(sys.argv[1:])  # vLLM's --lora-modules a=p b=q
    app()
