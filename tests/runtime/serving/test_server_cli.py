"""`plimsoll serve` flags: the documented options exist, and bad values fail fast with a clear message."""

import pytest
from typer.testing import CliRunner

from plimsoll.cli import app

ISSUE_FLAGS = [
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--kv-cache-memory",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--max-model-len",
    "--max-waiting",
    "--request-timeout",
    "--api-key",
]


def test_serve_help_lists_every_flag_of_the_issue() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for flag in ISSUE_FLAGS:
        assert flag in result.output, flag


def test_bad_settings_exit_2_naming_the_setting() -> None:
    result = CliRunner().invoke(app, ["serve", "--kv-cache-memory", "lots", "--port", "1"])
    assert result.exit_code == 2
    assert "kv_cache_memory" in result.output and "GiB" in result.output
    result = CliRunner().invoke(app, ["serve", "--dtype", "int3", "--port", "1"])
    assert result.exit_code == 2 and "dtype" in result.output
    result = CliRunner().invoke(app, ["serve", "--scheduling-policy", "fifo", "--port", "1"])
    assert result.exit_code == 2
    assert "scheduling_policy" in result.output and "'priority'" in result.output


def test_a_malformed_inference_objective_exits_2_saying_how_to_write_it() -> None:
    for command in ("serve", "route"):
        args = [command, "--inference-objective", "critical", "--port", "1"]
        if command == "route":
            args += ["--backend", "http://127.0.0.1:1"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "'critical' is not NAME=PRIORITY" in result.output and "interactive=10" in result.output


def test_lora_flags_exist_and_refuse_mistakes() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"):
        assert flag in result.output, flag
    result = CliRunner().invoke(app, ["serve", "--lora-modules", "a=/p", "--port", "1"])
    assert result.exit_code == 2 and "--lora-modules needs --enable-lora" in result.output
    result = CliRunner().invoke(app, ["serve", "--enable-lora", "--lora-modules", "a", "--port", "1"])
    assert result.exit_code == 2 and "not name=path" in result.output
    result = CliRunner().invoke(app, ["serve", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2", "--port", "1"])
    assert result.exit_code == 2 and "max_cpu_loras" in result.output


def test_cpu_kernel_flags_exist_and_refuse_a_build_that_is_not_one() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    for flag in ("--cpu-kernels", "--cpu-packed-weights", "--no-cpu-packed-weights"):
        assert flag in result.output, flag
    result = CliRunner().invoke(app, ["serve", "--cpu-kernels", "avx1024", "--port", "1"])
    assert result.exit_code == 2, result.output
    assert "cpu_kernels" in result.output and "'avx512'" in result.output and "'off'" in result.output


def test_the_collector_is_off_while_serve_starts_and_on_again_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up runs without the cyclic collector (what it allocates lives as long as the process);
    a start that fails leaves it on again (the server's on_ready turns it on once Ready)."""
    import gc

    from plimsoll.runtime import serve_args

    seen: list[bool] = []

    def choose(positional: str | None, option: str | None) -> str:
        seen.append(gc.isenabled())
        raise serve_args.ServeArgError("stop here")

    monkeypatch.setattr(serve_args, "choose_model", choose)
    assert gc.isenabled()
    result = CliRunner().invoke(app, ["serve", "--port", "1"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen == [False] and gc.isenabled()
