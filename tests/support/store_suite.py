"""The conformance suite every rollout-data backend passes, built the way ``train.py`` builds
its stores: from a ``transfer`` config, through ``rl.backends.data_path``: ``start_services``
on the driver and ``build`` in each process (a segment holder that lends memory as learner local rank 0
does, a producer here as the rollout manager, a consumer in another process, a Ray actor,
as a learner rank).

A test module runs the suite by importing its tests and providing a ``store_case``
fixture from ``registered_case(label)``, which reads ``rl.config.transfer.BACKENDS`` as the
benchmark and the matrices do: ``tests/integration/test_store_conformance.py`` for every entry,
``tests/integration/test_adding_a_backend.py`` for an entry that the test itself registers. Whether the
data behind a ref is still held is read from the backend itself by a probe of ``PROBES``
(keyed by schema class); a backend without one is checked through ``RemovedError`` alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import pytest

from rl.backends import data_path
from tests.support.batches import assert_same, make_batch
from tests.support.procs import wait_until
from transfer.data.base import RemovedError, RolloutStore, StoreRef


class Consumer:
    """Runs in another process: builds its own store from the driver's ``DataPath`` (which
    carries the config; a backend that a test registers is in the driver's registry only)
    and reads refs."""

    def __init__(self, path, runtime):
        self.store = path.build(runtime)

    def get(self, ref):
        cols = self.store.get(ref)
        return cols, dict(self.store.get_timings_ms)

    def close(self):
        self.store.close()


@dataclass
class StoreCase:
    label: str
    transfer: object
    """The ``transfer`` config the stores were built from."""
    producer: RolloutStore
    consumer: object
    """A Ray actor handle of ``Consumer``."""
    held: Optional[Callable[[StoreRef], bool]]
    """Whether the store still holds the data behind a ref, read from the backend itself
    (not through the store client under test); None when no probe is registered."""
    services: dict[str, str]


_RAY_IDS: dict[str, bytes] = {}


def ray_holds(services: dict, ref: StoreRef) -> bool:
    """The object is in the reference table of its owner (this process, which put it): Ray
    frees an object when it leaves that table."""
    import ray

    if ref.handle:  # remove() empties it: remember the object's id while it is there
        _RAY_IDS[ref.key] = ref.handle[0].hex().encode()
    return _RAY_IDS[ref.key] in ray._private.worker.global_worker.core_worker.get_all_reference_counts()


def mooncake_holds(services: dict, ref: StoreRef) -> bool:
    """Keys under the ref's key on the master (the bundle codec writes '_' for '/')."""
    from transfer.data.mooncake.master import list_keys

    return any(ref.key in k or ref.key.replace("/", "_") in k
               for k in list_keys(services["admin_url"]))


def _probes() -> dict[type, Callable[[dict, StoreRef], bool]]:
    from rl.config.transfer import MooncakeTransferConfig, RayTransferConfig

    return {RayTransferConfig: ray_holds, MooncakeTransferConfig: mooncake_holds}


PROBES: dict[type, Callable[[dict, StoreRef], bool]] = _probes()
"""Schema class -> leak probe; a test adding a backend may add its own."""


@contextmanager
def registered_case(label: str, runtime_dir: str, ray) -> Iterator[StoreCase]:
    """The stores of ``BACKENDS[label]``, built from its composed config as train.py builds them."""
    from rl.config import compose
    from rl.config.transfer import BACKENDS

    transfer = compose(*BACKENDS[label]).transfer
    probe = next((fn for cls, fn in PROBES.items() if isinstance(transfer, cls)), None)
    with open_case(label, transfer, runtime_dir, ray, probe) as case:
        yield case


@contextmanager
def open_case(label: str, transfer, runtime_dir: str, ray,
              probe: Optional[Callable[[dict, StoreRef], bool]],
              partition_bytes: int = 64 << 20) -> Iterator[StoreCase]:
    """Start ``transfer``'s services, open the stores of a step, and close everything after."""
    import dataclasses

    from rl.runtime import Runtime

    runtime = Runtime(f"conf-{label}", runtime_dir, "/unused")
    path = data_path(transfer)
    services, stop = path.start_services(runtime, num_nodes=1, partition_bytes=partition_bytes)
    runtime = dataclasses.replace(runtime, transfer=services)
    holder = producer = consumer = None
    try:
        holder = path.build(runtime, contribute_segment=True)
        producer = path.build(runtime)
        consumer = ray.remote(Consumer).remote(path, runtime)
        held = None if probe is None else (lambda ref: probe(services, ref))
        yield StoreCase(label, transfer, producer, consumer, held, services)
    finally:
        if consumer is not None:
            ray.get(consumer.close.remote())
            ray.kill(consumer)
        for store in (producer, holder):
            if store is not None:
                store.close()
        if stop is not None:
            stop()


def sample_columns(transfer=None):
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
    if getattr(transfer, "codec", None) == "bundle":  # Mooncake's bundle API: one row per sample per column
        cols = {k: v for k, v in cols.items() if v is not None and len(v) == 3}
    return cols


def test_the_store_follows_the_protocol(store_case: StoreCase):
    assert isinstance(store_case.producer, RolloutStore)
    assert isinstance(store_case.producer.get_timings_ms, dict)


def test_round_trip_across_processes(store_case: StoreCase, ray_local):
    case = store_case
    cols = sample_columns(case.transfer)
    ref = case.producer.put(cols, key=f"conf/{case.label}/round-trip")
    got, timings = ray_local.get(case.consumer.get.remote(ref))
    assert_same(cols, got)
    assert ref.nbytes > 0 and "put_ms" in ref.timings_ms
    assert all(isinstance(v, float) and v >= 0 for v in timings.values())
    case.producer.remove([ref])


def test_rollout_batch_round_trip(store_case: StoreCase, ray_local):
    from rl.types import RolloutBatch

    case = store_case
    batch = make_batch(12, seed=3)
    ref = case.producer.put(batch.to_columns(), key=f"conf/{case.label}/batch")
    got, _ = ray_local.get(case.consumer.get.remote(ref))
    out = RolloutBatch.from_columns(got)
    assert_same(batch.to_columns(), out.to_columns())
    case.producer.remove([ref])


def test_results_of_earlier_gets_stay_intact(store_case: StoreCase):
    """A learner holds what it read while it reads more: a later get on the same client must
    not overwrite an earlier result (a pooled receive buffer reused too early would)."""
    case = store_case
    batches = [make_batch(6, seed=s) for s in (1, 2, 3)]
    refs = [case.producer.put(b.to_columns(), key=f"conf/{case.label}/held-{i}")
            for i, b in enumerate(batches)]
    got = [case.producer.get(r) for r in refs]
    for batch, cols in zip(batches, got):
        assert_same(batch.to_columns(), cols)
    case.producer.remove(refs)


def test_remove_is_idempotent_and_leaves_nothing(store_case: StoreCase, ray_local):
    case = store_case
    ref = case.producer.put(sample_columns(case.transfer), key=f"conf/{case.label}/remove")
    got, _ = ray_local.get(case.consumer.get.remote(ref))  # read once elsewhere, as a learner does
    del got
    assert case.held is None or case.held(ref)
    case.producer.remove([ref])
    case.producer.remove([ref])  # twice: no error
    # a backend may free on its own time: Ray frees an object once its owner and every
    # borrower dropped it, and the consumer that read it reports its release in a message of its own
    assert case.held is None or wait_until(lambda: not case.held(ref))
    with pytest.raises(RemovedError, match="removed"):
        case.producer.get(ref)
    with pytest.raises(RemovedError, match="removed"):  # in another process too
        ray_local.get(case.consumer.get.remote(ref))


def test_a_ref_of_another_backend_is_refused(store_case: StoreCase):
    alien = StoreRef(key="conf/alien", backend="not-" + store_case.producer.backend, nbytes=1)
    with pytest.raises(ValueError, match="written by"):
        store_case.producer.get(alien)
    with pytest.raises(ValueError, match="written by"):
        store_case.producer.remove([alien])
