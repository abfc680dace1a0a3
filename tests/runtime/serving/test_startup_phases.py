"""The replica reports its own start-up: phases in /ready and as plimsoll_startup_phase_seconds, and its version."""

import httpx
from server_fixtures import chat_model_dir, scrape, server  # noqa: F401

from plimsoll import __version__
from plimsoll.runtime.engine.startup import PHASES, StartupTimeline
from plimsoll.runtime.testing import ThreadedServer

ENGINE_PHASES = ("weights_loaded", "kv_cache_allocated", "warmup_done", "ready")


def test_ready_body_and_metrics_carry_the_phases_in_order(server: ThreadedServer) -> None:  # noqa: F811
    body = httpx.get(f"{server.url}/ready", timeout=10).json()
    assert body["ready"] is True
    phases = body["startup"]["phaseSeconds"]
    # In-process servers skip the serve command, so "imports" is not marked by them.
    reached = [p for p in PHASES if p in phases]
    assert set(ENGINE_PHASES) <= set(reached), phases
    seconds = [phases[p] for p in reached]
    assert seconds == sorted(seconds), f"phases out of order: {phases}"
    assert body["startup"]["processStartTime"] > 0

    samples = scrape(server.url)
    for phase in ENGINE_PHASES:
        assert samples[f"plimsoll_startup_phase_seconds{{phase={phase}}}"] == phases[phase]
    assert samples[f"plimsoll_build_info{{version={__version__}}}"] == 1.0
    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": __version__}


def test_a_timeline_refuses_unknown_phases_and_counts_from_process_start() -> None:
    timeline = StartupTimeline(started_at=100.0)
    timeline.mark("imports", at=103.5)
    timeline.mark("weights_loaded", at=110.0)
    assert timeline.seconds() == {"imports": 3.5, "weights_loaded": 10.0}
    assert timeline.last_phase() == "weights_loaded"
    try:
        timeline.mark("compiled")
    except ValueError as error:
        assert "unknown start-up phase 'compiled'" in str(error)
    else:
        raise AssertionError("an unknown phase was accepted")
