"""diagnose with the GPUs' own series: DCGM-exporter fixtures in the exporter's names and label set.

Each fixture (tests/bench/fixtures/dcgm/*.prom) is a run of exporter scrapes, one per
second, with the HELP/TYPE lines of its counters CSV and its labels (gpu, UUID,
device, modelName, Hostname, namespace/pod/container). The server side is real
exposition of plimsoll's or vLLM's series (``test_diagnose.timeline``).
"""

from pathlib import Path

import pytest
from test_diagnose import Scenario, metrics_server, timeline
from typer.testing import CliRunner

from plimsoll import metric_names as mn
from plimsoll.bench.diagnose import analyse
from plimsoll.bench.scrape import Snapshot, parse_metrics
from plimsoll.cli import app

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm"
POD = "chat-6d9f7b8c4-x2k9p"
# A server with work running and a little waiting, nothing else strained.
BUSY = Scenario(running=8, waiting=2, kv=0.5)


def frames(name: str) -> list[str]:
    text = (FIXTURES / f"{name}.prom").read_text()
    return [part for part in text.split("# scrape ")[1:]]


def dcgm(name: str) -> list[Snapshot]:
    return [parse_metrics(frame.split("\n", 1)[1], t=float(i)) for i, frame in enumerate(frames(name))]


def server(scenario: Scenario = BUSY, fam: mn.EngineMetricNames = mn.PLIMSOLL) -> list[Snapshot]:
    before, after = timeline(fam, scenario)
    return [parse_metrics(before, t=0.0), parse_metrics(after, t=11.0)]


@pytest.mark.parametrize(
    ("fixture", "verdict", "words"),
    [
        ("cpu_starved", "host", "swings between 6% and 61%"),
        ("power_throttled", "throttling", "software power cap"),
        ("thermal_throttled", "throttling", "software thermal slowdown"),
        ("memory_full", "gpu_memory", "device memory peaked at 97.9%"),
    ],
)
def test_gpu_series_name_the_accelerator_layer(fixture: str, verdict: str, words: str) -> None:
    d = analyse(server(), gpu_samples=dcgm(fixture), gpu_filter=(POD, ()))
    assert d.verdict == verdict, d.summary
    assert words in " ".join(d.findings[0].evidence), d.findings[0].evidence
    assert d.findings[0].advice
    assert d.observed["gpu0_busy_mean"] > 0 and "gpu1_busy_mean" not in d.observed  # the pod's GPU only


def test_a_healthy_busy_gpu_is_not_blamed() -> None:
    d = analyse(server(), gpu_samples=dcgm("healthy"))
    assert d.verdict == "none", d.summary
    assert d.observed["gpu0_temp_max_c"] == 63


def test_without_work_a_low_utilisation_is_idle_not_starved() -> None:
    idle = Scenario(requests=0, running=0, waiting=0)
    d = analyse(server(idle), gpu_samples=dcgm("cpu_starved"))
    assert d.verdict == "no_traffic"


def test_throttling_outranks_the_slow_decode_it_causes() -> None:
    slow = Scenario(tpots_s=(0.05, 0.06, 0.25, 0.3), running=8, waiting=1, kv=0.5)
    d = analyse(server(slow, mn.VLLM), gpu_samples=dcgm("thermal_throttled"))
    assert [f.layer for f in d.findings][:2] == ["throttling", "decode"]


def test_batch_falling_to_zero_while_requests_wait_is_a_stall() -> None:
    before, after = timeline(mn.PLIMSOLL, Scenario(requests=4, running=0, waiting=5, kv=0.2))
    samples = [parse_metrics(before, 0.0)] + [parse_metrics(after, t) for t in (1.0, 2.0, 3.0)]
    d = analyse(samples)
    assert d.verdict == "stall", d.summary
    assert "the batch fell to zero in 3 of 4 scrapes" in d.findings[0].evidence[0]


def test_kv_allocation_failures_are_named() -> None:
    d = analyse(server(Scenario(running=4, waiting=1, kv=0.6, alloc_failures=3)))
    assert d.verdict == "kv_capacity"
    assert "3 KV block allocation failures" in " ".join(d.findings[0].evidence)


def test_cli_reads_the_exporter_beside_the_server() -> None:
    with (
        metrics_server(timeline(mn.PLIMSOLL, BUSY)) as url,
        metrics_server(frames_text("cpu_starved")) as exporter,
    ):
        result = CliRunner().invoke(
            app,
            ["diagnose", "--url", url, "--dcgm-url", exporter, "--dcgm-pod", POD, "--window", "1.5",
             "--interval", "0.1"],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "verdict: host" in result.output and "the CPU does not feed it" in result.output


def frames_text(name: str) -> list[str]:
    return [frame.split("\n", 1)[1] for frame in frames(name)]


def test_nvml_readings_come_out_in_the_exporters_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVML path's mapping, with NVML's Python module stood in for (no GPU here): the same
    names and units the exporter uses, so one analysis reads both."""
    import types

    from plimsoll.bench.accelerator import gpu_series, nvml_exposition

    nvml = types.SimpleNamespace(
        NVMLError=RuntimeError, NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: "GPU-1234", nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=100 * 2**30, free=40 * 2**30),
        nvmlDeviceGetTemperature=lambda h, kind: 71, nvmlDeviceGetPowerUsage=lambda h: 512_000,
        nvmlDeviceGetClockInfo=lambda h, kind: 1980, nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4,
    )  # fmt: skip
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    text = nvml_exposition()
    assert text is not None and 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-1234"' in text
    (g,) = gpu_series([parse_metrics(text, 0.0), parse_metrics(text, 1.0)])
    assert g.busy == [0.37, 0.37] and g.fb_used_mib[0] == 100 * 1024 and g.power_w[0] == 512.0
    assert g.temp_c[0] == 71 and g.reasons == [0x4, 0x4] and g.model == "NVIDIA H200"
