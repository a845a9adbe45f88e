"""The steps of docs/transfer.md, "Adding a backend", done inside this file and nowhere else:
a store with what starts it, a schema class, its entry in ``rl.backends``, a YAML and a
registry entry for a throwaway in-memory data path; then ``transfer=memory`` composes like
any built-in backend and the conformance suite (``tests/support/store_suite.py``) passes over it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import pytest

import rl.config.transfer as transfer_configs
from rl import backends
from rl.backends import DataPath
from rl.config.transfer import TransferConfig
from tests.support.env import compose
from tests.support.procs import wait_until
from tests.support.store_suite import (  # noqa: F401  (the suite's tests run here)
    PROBES, registered_case, test_a_ref_of_another_backend_is_refused,
    test_remove_is_idempotent_and_leaves_nothing, test_results_of_earlier_gets_stay_intact,
    test_rollout_batch_round_trip, test_round_trip_across_processes, test_the_store_follows_the_protocol)
from transfer.data import codec
from transfer.data.base import Columns, RemovedError, StoreRef


# -- 1. the store and what starts it: one file in transfer/data/ in real life -----------------
class Shelf:
    """A Ray actor holding encoded batches in its memory: the whole backend."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[bytes, bytes]] = {}
        self.lock = threading.Lock()

    def put(self, key: str, manifest: bytes, payload: bytes) -> None:
        with self.lock:
            self.items[key] = (manifest, payload)

    def get(self, key: str):
        return self.items.get(key)

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            self.items.pop(key, None)

    def keys(self) -> list[str]:
        return list(self.items)


class MemoryStore:
    backend = "memory"

    def __init__(self, shelf_name: str) -> None:
        import ray

        self._ray = ray
        self.shelf = ray.get_actor(shelf_name)
        self.location = None  # one shelf: nothing to place
        self.get_timings_ms: dict[str, float] = {}

    def put(self, columns: Columns, *, key: str, near: str | None = None) -> StoreRef:
        manifest, payload = codec.encode(columns)
        self._ray.get(self.shelf.put.remote(key, manifest, payload.tobytes()))
        return StoreRef(key=key, backend=self.backend, nbytes=int(payload.nbytes),
                        timings_ms={"put_ms": 0.0})

    def get(self, ref: StoreRef) -> Columns:
        self._check(ref)
        item = self._ray.get(self.shelf.get.remote(ref.key))
        if item is None:
            raise RemovedError(f"memory store: {ref.key!r} was removed")
        self.get_timings_ms = {"decode_ms": 0.0}
        return codec.decode(item[0], bytearray(item[1]))

    def remove(self, refs: Sequence[StoreRef]) -> None:
        for ref in refs:
            self._check(ref)
        self._ray.get(self.shelf.remove.remote([r.key for r in refs]))

    def close(self) -> None:
        pass

    def _check(self, ref: StoreRef) -> None:
        if ref.backend != self.backend:
            raise ValueError(f"ref {ref.key!r} was written by {ref.backend!r}, not by memory")


def start_shelf(name: str):
    """The backend's service, from plain values: the settings every client needs and a stop."""
    import ray

    shelf = ray.remote(Shelf).options(name=name).remote()
    ray.get(shelf.keys.remote())  # up before anyone looks it up
    return {"shelf": name}, lambda: ray.kill(shelf)


# -- 2. the schema: a class in rl/config/transfer.py, one entry in its SCHEMAS ----------------
@dataclass(kw_only=True)
class MemoryTransferConfig(TransferConfig):
    name: str = "memory"
    shelf_prefix: str = "rl-shelf"
    """Name prefix of the actor that holds the data."""


# -- 3. the glue: a DataPath in rl/backends.py, one entry in its DATA_PATHS -------------------
class MemoryDataPath(DataPath):
    cfg: MemoryTransferConfig

    def start_services(self, runtime, num_nodes, partition_bytes, batches_held=1):
        return start_shelf(f"{self.cfg.shelf_prefix}-{runtime.run_id}")

    def build(self, runtime, *, contribute_segment=False):
        return MemoryStore(runtime.transfer["shelf"])


# -- 4. the YAML: conf/transfer/memory.yaml ---------------------------------------------------
YAML = """\
defaults:
  - /schema/transfer/memory@_here_
  - _self_
name: memory
shelf_prefix: test-shelf
"""


def shelf_holds(services: dict, ref: StoreRef) -> bool:
    """The leak probe: read the shelf's own keys, not through the store client."""
    import ray

    return ref.key in ray.get(ray.get_actor(services["shelf"]).keys.remote())


@pytest.fixture(scope="module")
def memory_backend(tmp_path_factory):
    """Registers the backend as a real one is registered (schema, DATA_PATHS entry, YAML,
    BACKENDS entry) and takes it out again afterwards; returns its label."""
    conf = tmp_path_factory.mktemp("conf")
    (conf / "transfer").mkdir()
    (conf / "transfer" / "memory.yaml").write_text(YAML)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(transfer_configs.SCHEMAS, "memory", MemoryTransferConfig)
        mp.setitem(backends.DATA_PATHS, MemoryTransferConfig, MemoryDataPath)
        # 5. the registry entry: what the conformance suite, the matrices and the benchmark read
        mp.setitem(transfer_configs.BACKENDS, "memory",
                   ["transfer=memory", f"hydra.searchpath=[file://{conf}]"])
        mp.setitem(PROBES, MemoryTransferConfig, shelf_holds)  # the suite's leak check
        yield "memory"


def test_the_new_backend_composes_like_a_built_in_one(memory_backend):
    overrides = transfer_configs.BACKENDS[memory_backend]
    cfg = compose(*overrides, "transfer.shelf_prefix=other")
    assert isinstance(cfg.transfer, MemoryTransferConfig)
    assert isinstance(backends.data_path(cfg.transfer), MemoryDataPath)
    assert (cfg.transfer.name, cfg.transfer.shelf_prefix) == ("memory", "other")
    with pytest.raises(Exception, match="no_such_field"):
        compose(*overrides, "transfer.no_such_field=1")  # the schema is enforced


@pytest.fixture(scope="module")
def store_case(memory_backend, ray_local, tmp_path_factory):
    """The same path as test_store_conformance.py: the registry entry, composed and built."""
    with registered_case(memory_backend, str(tmp_path_factory.mktemp("memory")), ray_local) as case:
        assert isinstance(case.producer, MemoryStore) and case.held is not None
        yield case
        shelf = ray_local.get_actor(case.services["shelf"])
        assert ray_local.get(shelf.keys.remote()) == []  # every test removed its data
    # stopped with the case, as a master is (ray.kill returns before Ray drops the actor's name)
    assert wait_until(lambda: not _named_actor(ray_local, case.services["shelf"]))


def _named_actor(ray, name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False
