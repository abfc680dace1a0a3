"""The hold queue releases the best priority class first (lower vLLM ``priority``), FIFO within a class."""

import asyncio

from plimsoll.router.hold import ColdStarts, HoldQueue


async def test_held_requests_are_released_by_class_then_arrival() -> None:
    ready = [0]
    queue = HoldQueue(8, lambda: ready[0], ColdStarts(), release_concurrency=1)
    order: list[str] = []

    async def held(name: str, priority: int) -> None:
        await queue.hold(priority)
        order.append(name)

    tasks = []
    for name, prio in [("batch-1", 5), ("batch-2", 5), ("chat-1", 0), ("mid", 2), ("chat-2", 0)]:
        tasks.append(asyncio.create_task(held(name, prio)))
        await asyncio.sleep(0)  # let it enter the queue, in this order
    assert queue.held == 5
    ready[0] = 1
    for expected_count in range(1, 6):
        queue.pump() if expected_count == 1 else queue.done()  # one release per finished response
        while len(order) < expected_count:
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["chat-1", "chat-2", "mid", "batch-1", "batch-2"]
