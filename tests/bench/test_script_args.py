"""add_options: one typed --option per keyword default, for the benchmark scripts."""

import argparse

import pytest

from plimsoll.bench.script_args import add_options


def test_options_take_their_type_and_name_from_the_default() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, max_tokens=16, host_gib=1.0, model="tiny")
    assert parser.parse_args([]) == argparse.Namespace(max_tokens=16, host_gib=1.0, model="tiny")
    args = parser.parse_args(["--max-tokens", "8", "--host-gib", "2", "--model", "m"])
    assert (args.max_tokens, args.host_gib, args.model) == (8, 2.0, "m")
    assert isinstance(args.host_gib, float)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-tokens", "1.5"])


def test_a_bool_default_is_refused() -> None:
    with pytest.raises(TypeError, match="store_true"):
        add_options(argparse.ArgumentParser(), verbose=False)


def test_a_default_paired_with_text_becomes_the_options_help() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, low=(5.0, "requests/s before the step"), minutes=8)
    assert parser.parse_args(["--low", "7"]) == argparse.Namespace(low=7.0, minutes=8)
    assert "requests/s before the step" in " ".join(parser.format_help().split())
