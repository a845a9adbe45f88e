"""With fault tolerance, a pool whose every engine is down fails the request naming each
engine and how it ended; without it, the first engine's failure is raised as it is (no
engine runs: nothing listens on their ports). Engines killed for real:
tests/e2e/test_fault_tolerance.py."""

from __future__ import annotations

import pytest


def test_a_pool_with_every_engine_down_names_each():
    """No engine left: the request fails naming every engine and how it ended (no retry
    loop); without fault tolerance the first engine's failure is raised as it is."""
    import asyncio

    import aiohttp

    from rl.rollout.client import EngineClient, EngineError
    from rl.rollout.fanout import EnginePool
    from rl.rollout.fleet import EngineSet
    from transfer.net import free_port

    async def one(pool):
        async with aiohttp.ClientSession() as session:
            return await pool.generate(session, {"input_ids": [1], "sampling_params": {}}, 5)

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    pool = EnginePool(EngineSet([EngineClient(u, f"engine-{i}") for i, u in enumerate(urls)]), retry=True)
    with pytest.raises(EngineError, match="every engine is down") as e:
        asyncio.run(one(pool))
    assert all(f"engine-{i} ({u}): engine-{i}" in str(e.value) for i, u in enumerate(urls))
    assert pool.engines.state == ["down", "down"] and pool.retried == 2
    plain = EnginePool(EngineSet([EngineClient(u, f"engine-{i}") for i, u in enumerate(urls)]))
    with pytest.raises(EngineError, match="/generate: no answer") as e:
        asyncio.run(one(plain))
    assert "every engine" not in str(e.value) and plain.engines.state == ["live", "live"]
