"""--max-tenant-inflight-tokens: a tenant over its cap gets 429 naming the tenant and the limit."""

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


def test_requests_without_a_tenant_are_not_capped() -> None:
    ctx = context(10)
    ctx.admit("cmpl", None, 1000)
    assert ctx.tenant_tokens == {}
