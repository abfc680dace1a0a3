"""--max-tenant-inflight-tokens: a tenant over its cap gets 429 naming the tenant and the limit."""

from typing import Any

import pytest

from plimsoll.runtime.serving.errors import APIError
from plimsoll.runtime.serving.metrics import ServerMetrics
from plimsoll.runtime.serving.requests import ServingContext
from plimsoll.runtime.serving.settings import ServerSettings


def context(cap: int) -> ServingContext:
    settings = ServerSettings(served_model_name="m", max_tenant_inflight_tokens=cap)
    return ServingContext(engine=None, settings=settings, metrics=ServerMetrics("m"))


def test_cap_is_per_tenant_and_released_with_the_request() -> None:
    ctx = context(100)
    first = ctx.admit("cmpl", "team-a", 60)
    ctx.admit("cmpl", "team-b", 90)  # another tenant has its own allowance
    with pytest.raises(APIError) as refused:
        ctx.admit("cmpl", "team-a", 50)
    assert refused.value.status == 429
    message = str(refused.value.message)
    assert "'team-a'" in message and "--max-tenant-inflight-tokens 100" in message and "60" in message
    assert refused.value.headers["Retry-After"] == "1"
    first.release()
    ctx.admit("cmpl", "team-a", 100)  # the released tokens are available again
    assert ctx.tenant_tokens == {"team-a": 100, "team-b": 90}


def test_requests_without_a_tenant_share_one_capped_bucket() -> None:
    ctx = context(100)
    ctx.admit("cmpl", None, 80)
    with pytest.raises(APIError) as refused:
        ctx.admit("cmpl", None, 30)  # leaving the tenant out is no way around the cap
    assert refused.value.status == 429 and "without a tenant" in refused.value.message
    ctx.admit("cmpl", "team-a", 100)  # a named tenant has its own allowance
    assert ctx.tenant_tokens == {"": 80, "team-a": 100}


def test_a_client_cannot_raise_its_own_priority_but_an_objective_can() -> None:
    import types

    from plimsoll.objectives import OBJECTIVE_HEADER
    from plimsoll.runtime.serving.requests import priority_of

    settings = ServerSettings(served_model_name="m", inference_objectives={"interactive": -10})
    plain: Any = types.SimpleNamespace(headers={})
    assert priority_of(plain, -1000, settings) == 0  # clamped to --min-client-priority (0)
    assert priority_of(plain, 7, settings) == 7  # lowering one's own priority is allowed
    tagged: Any = types.SimpleNamespace(headers={OBJECTIVE_HEADER: "interactive"})
    assert priority_of(tagged, 5, settings) == -10  # the gateway's (router-set) objective is not clamped
    loose = ServerSettings(served_model_name="m", min_client_priority=-100)
    assert priority_of(plain, -1000, loose) == -100
