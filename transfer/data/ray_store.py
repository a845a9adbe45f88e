"""``transfer=ray``: the Ray object store as the rollout-data path, with either codec.

``transfer.codec`` chooses what is stored, independently of the transport:

* ``pickle`` (the default): the column dict as it is, with ``ray.put`` (pickle protocol 5:
  each numpy array one out-of-band buffer, which Ray copies once into its object store; a
  remote reader pulls them). The rollout batch's per-token fields are flat (``Ragged``), so
  a batch is a few buffers, and this was the faster codec on Ray, on one host and on two
  (docs/benchmarks.md, "The codec apart from the transport"). A dict of per-sample arrays,
  as some trainers keep it, is thousands of buffers and several times slower.
* ``packed``: our codec (``transfer.data.codec``): every field copied once into one
  contiguous uint8 buffer, stored with its manifest; ``ray.get`` maps that one buffer
  zero-copy from the node's shared memory (a remote node pulls it over TCP), and ``decode``
  rebuilds the columns as views into it. On Ray it pays two copies (encode, then ``ray.put``).

The ObjectRef is wrapped inside the ``StoreRef`` so that Ray does not resolve it when the
ref is passed as an argument of an actor call.

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

import numpy as np

from transfer.data import codec as packing
from transfer.data.base import Columns, RemovedError, StoreRef, columns_nbytes

CODECS = ("packed", "pickle")
"""What ``transfer.codec`` may name for this store."""


class RayStore:
    def __init__(self, codec: str = "pickle") -> None:
        if codec not in CODECS:
            raise ValueError(f"transfer.codec={codec!r}: the Ray store takes {' or '.join(CODECS)}")
        import ray  # here, not at the top: the config imports CODECS where Ray may be absent

        if not ray.is_initialized():
            raise RuntimeError("transfer=ray needs a running Ray (call ray.init first)")
        self._ray = ray
        self.codec = codec
        self.backend = f"ray-{codec}"
        self.location = None
        self.get_timings_ms: dict[str, float] = {}

    def put(self, columns: Columns, *, key: str, near: str | None = None) -> StoreRef:
        """``near`` is ignored: the object stays on the producer's node (Ray has no call that
        places it), and a reader on another node pulls it."""
        t0 = time.perf_counter()
        encode_ms = 0.0
        if self.codec == "packed":
            plan = packing.plan(columns)
            payload = np.empty(plan.nbytes, dtype=np.uint8)
            packing.write(plan, payload)
            value = (plan.manifest, payload)  # the array travels as one out-of-band buffer
            encode_ms = (time.perf_counter() - t0) * 1e3
        else:
            value = columns
        obj = self._ray.put(value)
        put_ms = (time.perf_counter() - t0) * 1e3  # encode included, as every store reports it
        return StoreRef(key=key, backend=self.backend, nbytes=columns_nbytes(columns),
                        handle=[obj], timings_ms={"put_ms": put_ms, "encode_ms": encode_ms})

    def get(self, ref: StoreRef) -> Columns:
        self._check(ref)
        if not ref.handle:
            raise RemovedError(f"ray store: {ref.key!r} was removed")
        value = self._ray.get(ref.handle[0])  # pickle: deserialising happens inside ray.get
        if self.codec == "pickle":
            self.get_timings_ms = {}
            return value
        t0 = time.perf_counter()
        columns = packing.decode(*value)
        self.get_timings_ms = {"decode_ms": (time.perf_counter() - t0) * 1e3}
        return columns

    def remove(self, refs: Sequence[StoreRef]) -> None:
        """Drop the ObjectRefs these refs hold (see the module docstring)."""
        for r in refs:
            self._check(r)
        for r in refs:
            r.handle.clear()

    def close(self) -> None:
        pass

    def _check(self, ref: StoreRef) -> None:
        if ref.backend != self.backend:
            raise ValueError(f"ref {ref.key!r} was written by {ref.backend!r}, not by {self.backend}")
