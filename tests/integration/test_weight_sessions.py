"""Weight-update sessions around a push, on the real CPU engine over HTTP: a failed push
closes its sessions so the next one can open them; a refused bucket fails the push at once."""

from __future__ import annotations

import time

import pytest
import torch

from rl.config import HFRolloutConfig
from rl.model import load_model
from rl.rollout.client import EngineClient
from rl.rollout.engines.launcher import EngineProcess
from transfer.weights.broadcast import BroadcastSync


@pytest.fixture
def engine(tiny_path, tmp_path):
    proc = EngineProcess(0, HFRolloutConfig(engine_start_timeout_s=120), tiny_path, seed=0,
                         log_dir=str(tmp_path), host="127.0.0.1")
    url = proc.start()
    yield proc, url
    proc.stop()


def _sync() -> BroadcastSync:
    return BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 16, backend="gloo",
                         timeout_s=60)


def test_a_failed_push_closes_its_sessions_and_the_next_push_works(engine, tiny_path):
    _, url = engine
    client = EngineClient(url, "engine-0", timeout_s=60)
    sync = _sync()
    sync.connect([client])
    try:
        with pytest.raises(RuntimeError, match="engine-0.*not in this model"):
            sync.push([("no.such.weight", torch.zeros(3))], 1)
        params = list(load_model(tiny_path).named_parameters())
        with torch.no_grad():
            params[0][1].add_(1.0)
        sync.push(params, 2)  # a session left open would make this `begin` answer 400
        assert client.get_weight_version() == "2"
        got = client.get_weights_by_name(params[0][0], truncate_size=4)
        assert torch.equal(torch.tensor(got), params[0][1].detach()[:4].float())
    finally:
        sync.close()


class _NoSession(EngineClient):
    """A sender bug on purpose: buckets without a session, which SGLang 0.5.21+ refuses."""

    def begin_weight_update(self) -> None:
        pass

    def end_weight_update(self) -> None:
        pass


def test_a_refused_bucket_fails_the_push_at_once_naming_the_engine(engine, tiny_path):
    proc, url = engine
    sync = _sync()
    sync.connect([_NoSession(url, "engine-0", timeout_s=60)])
    params = list(load_model(tiny_path).named_parameters())  # loaded before the clock starts
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        sync.push(params, 1)
    assert time.monotonic() - t0 < 10  # not the 60 s group timeout
    assert "engine-0" in str(e.value) and "begin_weight_update() and end_weight_update()" in str(e.value)
    proc.stop()  # the engine never joined the broadcast: end it before the group goes
    sync.close()


def test_a_bucket_refused_mid_push_still_gathers_every_parameter(engine, tiny_path):
    """After a failure the rank keeps gathering without sending: under FSDP every parameter's
    gather is a collective, and the other learner ranks would wait in it for 30 minutes."""
    _, url = engine
    client = EngineClient(url, "engine-0", timeout_s=60)
    sync = _sync()
    sync.connect([client])
    params = list(load_model(tiny_path).named_parameters())
    half = len(params) // 2
    poisoned = params[:half] + [("no.such.weight", torch.zeros(3))] + params[half:]
    gathered: list[str] = []

    def each_gathered():
        for name, p in poisoned:
            gathered.append(name)
            yield name, p

    try:
        with pytest.raises(RuntimeError, match="engine-0.*not in this model"):
            sync.push(each_gathered(), 1)
        assert gathered == [n for n, _ in poisoned]  # every parameter, after the failure too
        sync.push(params, 2)  # the session of the failed push was closed
        assert client.get_weight_version() == "2"
    finally:
        sync.close()
