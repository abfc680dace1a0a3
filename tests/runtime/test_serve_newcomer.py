"""`plimsoll serve` mistakes fail in one line before loading; vLLM spellings work."""

import socket
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from plimsoll.cli import app


def one_line(args: list[str]) -> str:
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_missing_model_fails_in_one_line_before_binding(tmp_path: Path) -> None:
    assert one_line(["/nonexistent", "--port", "1"]) == (
        "plimsoll serve: model /nonexistent does not exist; pass a model directory, a .gguf file, "
        "or smollm2-135m (embedded)"
    )
    assert one_line(["--model", str(tmp_path)]).startswith(
        f"plimsoll serve: model directory {tmp_path} has no config.json (nor a .gguf); pass a Hugging Face"
    )
    assert "`plimsoll fetch hf://org/other-model --local-dir DIR` and run `plimsoll serve DIR`" in one_line(
        ["org/other-model"]
    )


def test_port_in_use_is_one_line_naming_the_port(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = one_line(["--host", "127.0.0.1", "--port", str(port)])
    assert (
        line
        == f"plimsoll serve: port {port} on 127.0.0.1 is in use by another process; stop it or pass --port N"
    )


def test_vllm_flags_are_understood_and_bad_ones_say_what_works() -> None:
    assert one_line(["--dtype", "int3"]) == (
        "plimsoll serve: --dtype 'int3' is not a dtype; use auto, bfloat16 (bf16), float16 (half) or float32"
    )
    assert one_line(["--gpu-memory-utilization", "0.9"]) == (
        "plimsoll serve: --gpu-memory-utilization needs --device cuda; on CPU size the cache with "
        "--kv-cache-memory-bytes (or --kv-cache-memory 2GiB)"
    )
    assert (
        one_line(["a", "--model", "b"])
        == "plimsoll serve: two models given ('a' and --model 'b'); pass one of them"
    )
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "auto (float32 on CPU"):
        assert flag in help_text
    assert "<bool>" not in help_text


@pytest.mark.parametrize("dtype", ["auto", "bf16", "half"])
def test_vllm_dtype_spellings(dtype: str) -> None:
    from plimsoll.runtime.serve_args import resolve_dtype

    assert resolve_dtype(dtype, "cpu") in {"float32", "bfloat16", "float16"}
    assert resolve_dtype("auto", "cuda") == "bfloat16"


def test_device_and_attention_backend_auto_follow_the_machine() -> None:
    # --device auto takes CUDA where torch sees it (a GPU pod), else the CPU; --attention-backend
    # auto takes the Triton kernels (and decode CUDA graphs) on CUDA, torch's on a CPU.
    import torch

    from plimsoll.runtime.serve_args import resolve_attention_backend, resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"
    assert resolve_attention_backend("auto", "cpu") == "torch"
    pytest.importorskip("triton")
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cuda:1") == "triton"
    assert resolve_attention_backend("torch", "cuda") == "torch"


@pytest.mark.slow
def test_positional_model_serves_and_names_its_kernels_once(tmp_path: Path) -> None:
    from plimsoll.runtime.testing import ServerProcess, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    args = [str(model), "--dtype", "auto", "--kv-cache-memory-bytes", str(8 * 2**20)]
    with ServerProcess(args, startup_timeout=300) as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        log = server.log()
    assert [m["id"] for m in models["data"]] == [str(model)]
    kernel_lines = [ln for ln in log.splitlines() if "kernels:" in ln]
    assert len(kernel_lines) == 1, log
    assert "no C++ compiler" not in log.replace(kernel_lines[0], "")
