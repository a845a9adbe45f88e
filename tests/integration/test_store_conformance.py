"""The conformance suite (``tests/support/store_suite.py``) over every registered data backend
(``rl.config.transfer.BACKENDS``: Ray pickled and packed, Mooncake packed and bundle), each built from
its config as ``train.py`` builds it, with a real ``mooncake_master``; then what is
particular to Mooncake's two codecs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rl.config.transfer import BACKENDS
from tests.support.batches import assert_same
from tests.support.procs import pids_with
from tests.support.store_suite import (  # noqa: F401  (the suite's tests run here)
    registered_case, test_a_ref_of_another_backend_is_refused, test_remove_is_idempotent_and_leaves_nothing,
    test_results_of_earlier_gets_stay_intact, test_rollout_batch_round_trip, test_round_trip_across_processes,
    test_the_store_follows_the_protocol)
from transfer.data.base import Ragged
from transfer.data.mooncake import MooncakeSettings, MooncakeStore, StoreError, open_store
from transfer.data.mooncake.master import MooncakeMaster, list_keys


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def store_case(request, ray_local, tmp_path_factory):
    label = request.param
    with registered_case(label, str(tmp_path_factory.mktemp(label)), ray_local) as case:
        yield case
        if "admin_url" in case.services:
            assert list_keys(case.services["admin_url"]) == []  # every test removed its keys
    if "master_pid" in case.services:
        assert pids_with(f"-rpc_port={case.services['master_server_address'].rpartition(':')[2]}") == []


# -- Mooncake: a master of the module's own, the codecs' particulars -------------------------
@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = MooncakeMaster("127.0.0.1", log_path=str(tmp_path_factory.mktemp("mc") / "master.log")).start()
    yield m
    m.stop()
    assert pids_with(f"-rpc_port={m.rpc_port}") == []


def settings(master, **kw) -> MooncakeSettings:
    base = dict(master_server_address=master.address, metadata_server=master.metadata_server,
                local_hostname="127.0.0.1", global_segment_size=0, chunk_bytes=1 << 20)
    return MooncakeSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def segment_holder(master):
    holder = MooncakeStore(settings(master, global_segment_size=256 << 20))
    yield holder
    holder.close()


def keys_under(master, prefix: str) -> list[str]:
    return [k for k in master.keys() if prefix in k]


def test_bundle_limits_are_reported(master, segment_holder):
    store = open_store(settings(master, codec="bundle"))
    try:
        with pytest.raises(StoreError, match="one row per sample"):
            store.put({"a": np.zeros(3), "b": np.zeros(0)}, key="conf/bundle-ragged-rows")
    finally:
        store.close()


def test_many_chunks(master, segment_holder):
    store = MooncakeStore(settings(master, chunk_bytes=4096))
    try:
        big = {"x": [np.random.default_rng(0).random(5000).astype(np.float32) for _ in range(3)]}
        ref = store.put(big, key="conf/chunks")
        # the chunks only: the manifest travels in the ref
        assert len(ref.handle["keys"]) == (3 * 5000 * 4 + 64 + 4095) // 4096
        assert_same(big, store.get(ref))
        assert set(store.get_timings_ms) == {"decode_ms"}  # the learner logs transfer/decode_ms
        store.remove([ref])
        assert keys_under(master, "conf/chunks") == []
    finally:
        store.close()


def test_two_puts_under_one_key_keep_both_values(master, segment_holder):
    """Mooncake keeps the old value on a second put to a key: every put writes fresh keys, so
    a repeated key (a step generated again) reads what was put, without a check first."""
    store = MooncakeStore(settings(master))
    try:
        first = store.put({"a": np.ones(3)}, key="conf/dup")
        second = store.put({"a": np.zeros(3)}, key="conf/dup")
        assert not set(first.handle["keys"]) & set(second.handle["keys"])
        np.testing.assert_array_equal(store.get(first)["a"], np.ones(3))
        np.testing.assert_array_equal(store.get(second)["a"], np.zeros(3))
        store.remove([first, second])
        assert keys_under(master, "conf/dup") == []
    finally:
        store.close()


def test_packed_get_is_zero_copy_and_buffers_are_reused(master, segment_holder):
    import gc

    store = MooncakeStore(settings(master))
    try:
        ref = store.put({"a": [np.arange(1000, dtype=np.int64)] * 4}, key="conf/zc")
        for _ in range(5):
            cols = store.get(ref)
            assert not cols["a"][0].flags.owndata
            del cols
            gc.collect()
        assert len(store.receive.all) == 1  # one registered buffer served all five gets
        held = store.get(ref)
        second = store.get(ref)  # the first result is still alive: a second buffer
        assert len(store.receive.all) == 2
        np.testing.assert_array_equal(held["a"][3], np.arange(1000))
        del held, second
        store.remove([ref])
    finally:
        store.close()


def test_segment_too_small_says_what_to_raise(master, tmp_path):
    """A store whose only segment is tiny: the put fails, names the setting, leaves no key."""
    m = MooncakeMaster("127.0.0.1", log_path=str(tmp_path / "m.log")).start()
    small = MooncakeStore(settings(m, global_segment_size=16 << 20))  # the minimum
    producer = MooncakeStore(settings(m))
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="global_segment_size"):
            producer.put({"x": np.zeros(24 << 20, dtype=np.uint8)}, key="conf/too-big")
        assert time.monotonic() - t0 < 10
        assert m.keys() == []
    finally:
        producer.close()
        small.close()
        m.stop()


def test_unreachable_master_is_a_clear_error():
    from transfer.net import free_port

    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        MooncakeStore(MooncakeSettings(master_server_address=f"127.0.0.1:{free_port()}",
                                       metadata_server="http://127.0.0.1:1/metadata",
                                       local_hostname="127.0.0.1"))
    assert time.monotonic() - t0 < 10


def _loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        return next(int(line.split(":")[1].split()[0]) for line in f if line.strip().startswith("lo:"))


@pytest.mark.parametrize("codec", ["packed", "pickle"])
def test_a_partition_put_near_its_reader_is_read_without_the_network(master, codec):
    """Two learner ranks each lend a segment; the manager puts each rank's partition near it:
    the data sits in that rank's segment, and the rank reads it with a local copy (no byte
    over loopback TCP), where a reader of another rank's segment pulls it over TCP."""
    ranks = [open_store(settings(master, global_segment_size=128 << 20, codec=codec)) for _ in range(2)]
    producer = open_store(settings(master, codec=codec))
    payload = {"x": np.random.default_rng(0).random(4 << 20).astype(np.float32)}  # 16 MB
    try:
        assert ranks[0].location != ranks[1].location and producer.location is None
        for reader in ranks:
            ref = producer.put(payload, key=f"conf/near-{codec}", near=reader.location)
            where = {producer.client.get_replica_desc(k)[0].get_memory_descriptor()
                     .buffer_descriptor.transport_endpoint for k in ref.handle["keys"]}
            assert where == {reader.location}
            other = ranks[1] if reader is ranks[0] else ranks[0]
            moved = {}
            for who in (reader, other):
                before = _loopback_bytes()
                np.testing.assert_array_equal(who.get(ref)["x"], payload["x"])
                moved[who is reader] = _loopback_bytes() - before
            # the other rank's read crosses loopback TCP with the whole payload; the reader's
            # moves at most a little control traffic (and whatever else runs on the machine)
            assert moved[False] > 16e6 and moved[True] < 1.6e6, moved
            producer.remove([ref])
        assert keys_under(master, f"conf/near-{codec}") == []
    finally:
        for store in (producer, *ranks):
            store.close()


def test_the_waiting_thread_switch_moves_the_calls_to_a_niced_thread(master, segment_holder, monkeypatch):
    """``RL_MOONCAKE_WAIT_NICE`` (a measurement switch): the transfer calls run in one thread
    whose nice value is raised by that much, and the data round-trips as without it."""
    import os
    import threading

    from transfer.data.mooncake.packed import WAIT_NICE_ENV

    monkeypatch.setenv(WAIT_NICE_ENV, "5")
    store = MooncakeStore(settings(master))
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        theirs = store._run(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert theirs == min(mine + 5, 19)
        cols = {"a": Ragged.from_lengths(np.arange(10, dtype=np.int32), [3, 0, 7])}
        ref = store.put(cols, key="conf/niced")
        assert store.get(ref)["a"][2].tolist() == list(range(3, 10))
        store.remove([ref])
    finally:
        store.close()
    assert store._waiter.pool._shutdown
