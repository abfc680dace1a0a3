"""vLLM's multi-value flags (``--lora-modules a=p b=q``, ``--served-model-name``) parse wherever they stand.

Each case goes through :func:`expand_multi_value_flags` and then click's own parser for
`plimsoll serve` (``make_context``: parsed, not run), as the `plimsoll` entry point does.
"""

import pytest
import typer
from typer.exceptions import TyperException

from plimsoll.cli import app
from plimsoll.runtime.serve_args import (
    ServeArgError,
    expand_multi_value_flags,
    parse_lora_module,
    served_name,
)

JSON_MODULE = '{"name": "c", "path": "/r"}'


def _parse(argv: list[str]) -> dict[str, object]:
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    ctx = serve.make_context("serve", expand_multi_value_flags(argv))
    return dict(ctx.params)


@pytest.mark.parametrize(
    "argv",
    [
        # end of the line: the case that used to leave a dangling --lora-modules
        ["/m", "--enable-lora", "--lora-modules", "a=/p", "b=/q", JSON_MODULE],
        # middle
        ["/m", "--lora-modules", "a=/p", "b=/q", JSON_MODULE, "--enable-lora", "--port", "1"],
        # start, with the positional model after the values
        ["--lora-modules", "a=/p", "b=/q", JSON_MODULE, "/m", "--enable-lora"],
        # click's repeated form still works, and mixes with the vLLM form
        ["/m", "--enable-lora", "--lora-modules", "a=/p", "--lora-modules", "b=/q", JSON_MODULE],
    ],
    ids=["end", "middle", "start", "repeated"],
)
def test_lora_modules_parse_at_any_position(argv: list[str]) -> None:
    params = _parse(argv)
    assert params["lora_modules"] == ["a=/p", "b=/q", JSON_MODULE]
    assert params["model_arg"] == "/m" and params["enable_lora"] is True


@pytest.mark.parametrize(
    "argv",
    [["/m", "--served-model-name", "x"], ["--served-model-name", "x", "--port", "1", "/m"]],
    ids=["end", "start"],
)
def test_served_model_name_parses_at_any_position(argv: list[str]) -> None:
    params = _parse(argv)
    assert params["served_model_name"] == ["x"] and params["model_arg"] == "/m"
    assert served_name(params["served_model_name"]) == "x"  # type: ignore[arg-type]


def test_several_served_names_get_a_clear_error() -> None:
    params = _parse(["--served-model-name", "x", "y", "--port", "1"])
    assert params["served_model_name"] == ["x", "y"]
    with pytest.raises(ServeArgError, match="serves a model under one name; pass one"):
        served_name(params["served_model_name"])  # type: ignore[arg-type]


def test_a_multi_value_flag_without_a_value_says_it_needs_one() -> None:
    with pytest.raises(TyperException, match="requires an argument"):
        _parse(["/m", "--lora-modules"])
    # click takes the next word whatever it is; the module parser then says what a value looks like
    params = _parse(["--lora-modules", "--port", "1"])
    with pytest.raises(ServeArgError, match="not name=path"):
        parse_lora_module(params["lora_modules"][0])  # type: ignore[index]


def test_expansion_leaves_other_words_alone() -> None:
    argv = ["serve", "/m", "--port", "1", "--lora-modules=a=/p", "--enable-lora"]
    assert expand_multi_value_flags(argv) == argv
