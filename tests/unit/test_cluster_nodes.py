"""Bad two-node input is refused naming what is missing, from the nodes Ray would list (no
Ray here); the driver's watchdog names a port that stopped listening."""

from __future__ import annotations

import socket

import pytest

from rl.driver.nodes import check_nodes
from tests.support.env import compose


def _node(ip: str, **resources: float) -> dict:
    return {"Alive": True, "NodeID": ip, "NodeManagerAddress": ip,
            "Resources": {"CPU": 2.0, "memory": 1e9, f"node:{ip}": 1.0, **resources}}


HEAD, WORKER = _node("10.0.0.1", rollout_node=1), _node("10.0.0.2", train_node=1)


def test_two_node_placement_is_two_node_8x8_with_other_numbers():
    cpu = compose("cluster=two_node").cluster
    gpu = compose("cluster=two_node_8x8", "rollout=sglang", "model.dtype=bfloat16").cluster
    same = ("address", "min_nodes", "engine_resource", "learner_resource")
    assert [getattr(cpu, f) for f in same] == [getattr(gpu, f) for f in same] == \
        ["auto", 2, "rollout_node", "train_node"]
    assert (cpu.gpus_per_engine, cpu.gpus_per_learner) == (0, 0)
    check_nodes(cpu, [HEAD, WORKER])


@pytest.mark.parametrize("nodes,fragment", [
    ([HEAD], "cluster=two_node needs 2 Ray nodes but the Ray cluster has 1 (10.0.0.1 ['rollout_node'])"),
    ([HEAD, _node("10.0.0.2")], "no Ray node has the resource 'train_node' that cluster.learner_resource "
                                "pins the training pool to"),
    ([_node("10.0.0.1"), WORKER], "no Ray node has the resource 'rollout_node'"),
    ([HEAD, {**WORKER, "Alive": False}], "has 1"),
    ([_node("10.0.0.1", rollout_node=1, train_node=1), _node("10.0.0.2")],
     "only ['10.0.0.1'] can hold them"),
])
def test_missing_node_or_resource_is_named(nodes, fragment):
    with pytest.raises(ValueError) as e:
        check_nodes(compose("cluster=two_node").cluster, nodes)
    assert fragment in str(e.value)
    assert "ray start" in str(e.value) or "start_worker.sh" in str(e.value)


def test_gpu_pool_larger_than_the_nodes_is_refused():
    cfg = compose("cluster=two_node_8x8", "rollout=sglang", "model.dtype=bfloat16").cluster
    with pytest.raises(ValueError, match=r"rollout pool needs 8 x 1 GPUs but the nodes with "
                                         r"'rollout_node' have 4"):
        check_nodes(cfg, [_node("10.0.0.1", rollout_node=1, GPU=4), _node("10.0.0.2", train_node=1, GPU=8)])


def test_watchdog_names_a_port_that_stopped_listening():
    from rl.driver.watchdog import Watchdog

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    dog = Watchdog()
    dog.watch_port("the master", "127.0.0.1", port)
    assert dog.check_now() is None
    srv.close()
    assert dog.check_now().startswith(f"the master died: 127.0.0.1:{port} refuses")


def test_after_a_failure_the_watchdog_probes_until_a_death_shows(monkeypatch):
    """``check_settling`` (the cluster's exit after an error): a master that still answers
    the first probe and refuses the next (its process finishing its exit) is named; a healthy
    one is probed ``misses`` rounds and named nothing."""
    import rl.probe
    from rl.driver import watchdog
    from rl.driver.watchdog import Watchdog

    answers = iter([("up", None), ("refused", "127.0.0.1:9 refuses connections")])
    monkeypatch.setattr(watchdog, "probe_port", lambda host, port: next(answers))
    dog = Watchdog(period_s=0.01)
    dog.watch_port("the master", "127.0.0.1", 9)
    assert dog.check_settling() == "the master died: 127.0.0.1:9 refuses connections"
    monkeypatch.setattr(watchdog, "probe_port", rl.probe.probe_port)
    srv = socket.create_server(("127.0.0.1", 0))
    healthy = Watchdog(period_s=0.01)
    healthy.watch_port("the master", "127.0.0.1", srv.getsockname()[1])
    assert healthy.check_settling() is None
    srv.close()


def test_a_port_without_answer_is_a_miss_and_dead_only_after_repeated_misses(monkeypatch):
    """``rl.probe``: a refusal is a death at once; no answer (a listener whose accept queue
    is full drops the handshake) is a miss, which the watchdog counts: dead at the third in
    a row, and an answer resets it."""
    import rl.probe
    from rl.driver.watchdog import Watchdog

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    queued = []
    try:
        with pytest.raises(TimeoutError):
            for _ in range(8):  # fill the accept queue; then a handshake gets no answer
                queued.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
        outcome = rl.probe.probe_port("127.0.0.1", port, timeout_s=0.2)
        assert outcome == ("miss", f"no answer on 127.0.0.1:{port}")
    finally:
        for c in queued:
            c.close()
        srv.close()
    assert rl.probe.probe_port("127.0.0.1", port)[0] == "refused"
    outcomes = iter([("miss", "no answer on h:1")] * 2 + [("up", None)] + [("miss", "no answer on h:1")] * 3)
    monkeypatch.setattr("rl.driver.watchdog.probe_port", lambda host, port: next(outcomes))
    dog = Watchdog(misses=3)
    dog.watch_port("master", "h", 1)
    assert [dog.check_now() for _ in range(5)] == [None] * 5
    assert dog.check_now() == "master died: no answer on h:1 for 3 probes"
