"""``transfer=ray``: the Ray object store as the rollout-data path.

The column dict is stored as is with ``ray.put`` (numpy arrays go into shared memory and
are read back zero-copy on the same node; a remote node pulls them over TCP). The
ObjectRef is wrapped inside the ``StoreRef`` so that Ray does not resolve it when the ref
is passed as an argument of an actor call.

Ray frees an object when the last ObjectRef to it is gone, and Ray 2.60 has no call that
frees one earlier (``ray.internal.free`` is gone). ``remove`` therefore drops the ObjectRef
that the ``StoreRef`` holds in this process: the object is freed as soon as no process
holds the ref any more (the producer keeps none; a learner drops its copy when its step
returns), not when the caller's ``StoreRef`` happens to be garbage-collected. A removed
``StoreRef``, and any copy of it sent to another process afterwards, reads as
``RemovedError``.
"""

from __future__ import annotations

import time
from typing import Sequence

import ray

from transfer.data.base import Columns, RemovedError, StoreRef, columns_nbytes


class RayStore:
    backend = "ray"

    def __init__(self) -> None:
        if not ray.is_initialized():
            raise RuntimeError("transfer=ray needs a running Ray (call ray.init first)")
        self._ray = ray
        self.get_timings_ms: dict[str, float] = {}  # deserialising happens inside ray.get

    def put(self, columns: Columns, *, key: str) -> StoreRef:
        t0 = time.perf_counter()
        obj = self._ray.put(columns)
        put_ms = (time.perf_counter() - t0) * 1e3
        return StoreRef(key=key, backend=self.backend, nbytes=columns_nbytes(columns),
                        handle=[obj], timings_ms={"put_ms": put_ms, "encode_ms": 0.0})

    def get(self, ref: StoreRef) -> Columns:
        if ref.backend != self.backend:
            raise ValueError(f"ref {ref.key!r} was written by {ref.backend!r}, not by ray")
        if not ref.handle:
            raise RemovedError(f"ray store: {ref.key!r} was removed")
        return self._ray.get(ref.handle[0])

    def remove(self, refs: Sequence[StoreRef]) -> None:
        """Drop the ObjectRefs these refs hold (see the module docstring)."""
        for r in refs:
            if r.backend != self.backend:
                raise ValueError(f"ref {r.key!r} was written by {r.backend!r}, not by ray")
        for r in refs:
            r.handle.clear()

    def close(self) -> None:
        pass
