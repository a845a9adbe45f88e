"""One conformance suite for every RolloutStore backend: Ray, Mooncake packed, Mooncake bundle.

Producer in this process, consumer in another (a Ray actor), a real ``mooncake_master``,
and for Mooncake a separate client that lends the segment (as learner local rank 0 does).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.conftest import pids_with
from tests.test_codec import assert_same
from tests.test_learner import make_batch
from transfer.data.base import RolloutStore
from transfer.data.mooncake_master import MooncakeMaster
from transfer.data.mooncake_client import MooncakeSettings, StoreError, open_store
from transfer.data.mooncake_store import MooncakeStore

BACKENDS = ["ray", "mooncake-packed", "mooncake-bundle"]


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


def make_store(backend: str, master_address=None, metadata=None, **kw) -> RolloutStore:
    if backend == "ray":
        from transfer.data.ray_store import RayStore

        return RayStore()
    codec = backend.split("-")[1]
    return open_store(MooncakeSettings(master_server_address=master_address,
                                          metadata_server=metadata, local_hostname="127.0.0.1",
                                          codec=codec, chunk_bytes=kw.get("chunk_bytes", 1 << 20)))


class Consumer:
    """Runs in another process: reads refs and sends the columns back."""

    def __init__(self, backend, master_address, metadata):
        self.store = make_store(backend, master_address, metadata)

    def get(self, ref):
        cols = self.store.get(ref)
        return cols, {k: [type(x).__name__ for x in v] if isinstance(v, list) else type(v).__name__
                      for k, v in cols.items()}

    def close(self):
        self.store.close()


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request, ray_local, master, segment_holder):
    backend = request.param
    producer = make_store(backend, master.address, master.metadata_server)
    consumer = ray_local.remote(Consumer).remote(backend, master.address, master.metadata_server)
    yield backend, producer, consumer
    ray_local.get(consumer.close.remote())
    ray_local.kill(consumer)
    producer.close()


def sample_columns(backend: str = "ray"):
    cols = {
        "tokens": [np.arange(5, dtype=np.int32), np.zeros(0, dtype=np.int32),  # empty response
                   np.arange(300, dtype=np.int32)],
        "logprobs": [np.full(2, -1.5, np.float32), np.zeros(0, np.float32), np.ones(7, np.float32)],
        "pairs": [np.ones((2, 3), np.int16), np.zeros((0, 3), np.int16), np.ones((1, 3), np.int16)],
        "rewards": np.array([0.5, -1.0, 2.0], dtype=np.float32),
        "empty_dense": np.zeros((0,), dtype=np.float64),
        "matrix": np.arange(12, dtype=np.float64).reshape(3, 4),
        "sample_id": [1, 2, 3],
        "flags": [True, False, True],
        "scores": [0.25, 1e-30, -3.5],
        "label": ["héllo", "日本語", "emoji 🎉"],
        "maybe": ["x", None, "z"],
        "meta": {"step": 3, "note": "ünïcode"},
        "nothing": None,
        "no_rows": [],
    }
    if backend == "mooncake-bundle":  # Mooncake's bundle API needs one row per sample per column
        cols = {k: v for k, v in cols.items() if v is not None and len(v) == 3}
    return cols


def keys_under(master, prefix: str) -> list[str]:
    return [k for k in master.keys() if prefix in k]


def test_round_trip_across_processes(pair, ray_local):
    backend, producer, consumer = pair
    cols = sample_columns(backend)
    ref = producer.put(cols, key=f"conf/{backend}/round-trip")
    got, _ = ray_local.get(consumer.get.remote(ref))
    assert_same(cols, got)
    assert ref.nbytes > 0 and "put_ms" in ref.timings_ms
    producer.remove([ref])


def test_rollout_batch_round_trip(pair, ray_local):
    from rl.types import RolloutBatch

    backend, producer, consumer = pair
    batch = make_batch(12, seed=3)
    ref = producer.put(batch.to_columns(), key=f"conf/{backend}/batch")
    got, _ = ray_local.get(consumer.get.remote(ref))
    out = RolloutBatch.from_columns(got)
    assert_same(batch.to_columns(), out.to_columns())
    producer.remove([ref])


def held(backend: str, master, key: str, object_id: bytes | None) -> bool:
    """Whether the store still holds the data put under ``key``: Mooncake, keys under it on
    the master; Ray, the object in the reference table of its owner (this process, which
    put it): Ray frees an object when it leaves that table."""
    if backend == "ray":
        import ray

        return object_id in ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    return bool(keys_under(master, key) or keys_under(master, key.replace("/", "_")))


def test_remove_is_idempotent_and_leaves_no_key(pair, master, ray_local):
    from transfer.data.base import RemovedError

    backend, producer, consumer = pair
    key = f"conf/{backend}/remove"
    ref = producer.put(sample_columns(backend), key=key)
    object_id = ref.handle[0].hex().encode() if backend == "ray" else None
    got, _ = ray_local.get(consumer.get.remote(ref))  # read once elsewhere, as a learner does
    del got
    assert held(backend, master, key, object_id)
    producer.remove([ref])
    producer.remove([ref])  # twice: no error
    assert not held(backend, master, key, object_id)
    with pytest.raises(RemovedError, match="removed"):
        producer.get(ref)
    with pytest.raises(RemovedError, match="removed"):  # in another process too
        ray_local.get(consumer.get.remote(ref))


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
        assert len(ref.handle["keys"]) == (3 * 5000 * 4 + 64 + 4095) // 4096 + 1  # + manifest
        assert_same(big, store.get(ref))
        assert set(store.get_timings_ms) == {"decode_ms"}  # the learner logs transfer/decode_ms
        store.remove([ref])
        assert keys_under(master, "conf/chunks") == []
    finally:
        store.close()


def test_put_to_an_existing_key_is_refused(master, segment_holder):
    store = MooncakeStore(settings(master))
    try:
        ref = store.put({"a": np.ones(3)}, key="conf/dup")
        with pytest.raises(StoreError, match="already holds keys"):
            store.put({"a": np.zeros(3)}, key="conf/dup")
        np.testing.assert_array_equal(store.get(ref)["a"], np.ones(3))
        store.remove([ref])
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
