"""The simulator's step-cost switch: one replica that becomes slower mid-run (the ProfileDrift tests' tool)."""

import httpx

from plimsoll.bench.simulator import ServiceCurve, serving_simulator
from plimsoll.metric_names import PLIMSOLL
from plimsoll.prometheus import parse

STEP_S = 0.01


async def _tpot_sum_and_count(http: httpx.AsyncClient) -> tuple[float, float]:
    tpot = parse((await http.get("/metrics")).text).histogram(PLIMSOLL.tpot)
    assert tpot is not None
    return tpot.sum, tpot.count


async def test_a_larger_step_cost_slows_every_step_from_the_switch_on() -> None:
    async with (
        serving_simulator(ServiceCurve(step_t0_s=STEP_S)) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        body = {"model": "sim-model", "prompt": "a b", "max_tokens": 6}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        before = await _tpot_sum_and_count(http)
        assert (await http.put("/sim/step-cost", json={"scale": 5})).json() == {"scale": 5.0}
        for _ in range(3):
            assert (await http.post("/v1/completions", json=body)).status_code == 200
        after = await _tpot_sum_and_count(http)
        # Token times are deadlines: a first token a loaded host delivered late is caught up by
        # shorter sleeps after it, so TPOT may undercut 5 × the step by that lateness spread over
        # the request's 5 decode tokens; half of it is still far above the unswitched step.
        mean_tpot = (after[0] - before[0]) / (after[1] - before[1])
        assert mean_tpot >= 2.5 * STEP_S
        refused = await http.put("/sim/step-cost", json={"scale": 0})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith('"scale" must be a positive number')
