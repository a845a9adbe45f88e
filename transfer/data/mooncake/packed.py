"""``transfer=mooncake_tcp`` / ``mooncake_rdma`` with ``transfer.codec=packed`` (the default):
our codec over Mooncake Store.

The column dict is laid out by ``transfer.data.codec`` straight into a registered staging
buffer (the only copy), written in ``chunk_bytes`` chunks with one ``batch_put_from``,
then the JSON manifest is written **last**, so a reader never sees a half batch. ``get``
reads the manifest (carried in the ref, else from the store), pulls every chunk with one
``batch_get_into`` into a registered receive buffer and returns zero-copy views of it. The
receive buffer goes back to the pool when the last view is garbage-collected.

Guards for known Mooncake behaviour (measured on 0.3.13.post1):
a second put to an existing key keeps the old value (keys are checked to be new first);
``put(key, ndarray)`` stores ``len`` not ``nbytes`` bytes (we only ``put_from`` byte
ranges); ``remove`` fails inside the lease TTL (we pass ``force=True``); data lives in the
segment of the client that mounted it and vanishes when that client closes.
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
import time
import weakref
from typing import Sequence

import numpy as np

from transfer.data import codec
from transfer.data.base import Columns, StoreRef
from transfer.data.mooncake.client import (NOT_FOUND, MooncakeClient, MooncakeSettings, StoreError,
                                           StoreRemovedError)


class _Buffer:
    __slots__ = ("array", "ptr", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.array[::4096] = 0  # touch every page before registering it
        self.ptr = self.array.ctypes.data
        self.nbytes = nbytes


class _BufferPool:
    """Host buffers registered once with the client and reused (registration per call
    dominates the cost of small transfers)."""

    def __init__(self, client) -> None:
        self.client = client
        self.free: list[_Buffer] = []
        self.all: list[_Buffer] = []
        self.lock = threading.Lock()

    def acquire(self, nbytes: int) -> _Buffer:
        with self.lock:
            fits = [b for b in self.free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self.free.remove(buf)
                return buf
        buf = _Buffer(max(1 << 20, 1 << max(nbytes - 1, 1).bit_length()))
        rc = self.client.register_buffer(buf.ptr, buf.nbytes)
        if rc != 0:
            raise StoreError(f"register_buffer of {buf.nbytes} bytes failed (code {rc})")
        with self.lock:
            self.all.append(buf)
        return buf

    def release(self, buf: _Buffer) -> None:
        with self.lock:
            if buf in self.all:
                self.free.append(buf)

    def close(self) -> None:
        with self.lock:
            for buf in self.all:
                self.client.unregister_buffer(buf.ptr)
            self.all.clear()
            self.free.clear()


class MooncakeStore(MooncakeClient):
    """The packed codec (one registered buffer per batch, chunked)."""

    codec = "packed"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self.staging = _BufferPool(self.client)
        self.receive = _BufferPool(self.client)

    # -- put ---------------------------------------------------------------------------
    def put(self, columns: Columns, *, key: str) -> StoreRef:
        t0 = time.perf_counter()
        plan = codec.plan(columns)
        n = plan.nbytes
        chunk = self.settings.chunk_bytes
        chunk_keys = [f"{key}/{i}" for i in range((n + chunk - 1) // chunk)]
        manifest_key = f"{key}/manifest"
        plan.manifest["chunk_bytes"] = chunk
        manifest = plan.manifest_bytes()
        # a put to an existing key keeps the old value: refuse instead of serving stale data
        exists = self.client.batch_is_exist(chunk_keys + [manifest_key])
        if any(e == 1 for e in exists):
            raise StoreError(f"Mooncake store already holds keys under {key!r}; keys must be new "
                             "(a second put would keep the old value)")
        mat = codec.align(n)  # the manifest follows the payload in the staging buffer
        buf = self.staging.acquire(mat + len(manifest))
        written: list[str] = []
        try:
            codec.write(plan, buf.array[:n])
            buf.array[mat:mat + len(manifest)] = np.frombuffer(manifest, np.uint8)
            t1 = time.perf_counter()
            if chunk_keys:
                ptrs = [buf.ptr + i * chunk for i in range(len(chunk_keys))]
                sizes = [min(chunk, n - i * chunk) for i in range(len(chunk_keys))]
                rcs = self.client.batch_put_from(chunk_keys, ptrs, sizes, self.replicate)
                written = [k for k, rc in zip(chunk_keys, rcs) if rc == 0]
                bad = [rc for rc in rcs if rc != 0]
                if bad:
                    raise self._fail(f"put of {key!r} ({len(bad)} of {len(rcs)} chunks)", bad[0])
            rc = self.client.put_from(manifest_key, buf.ptr + mat, len(manifest), self.replicate)
            if rc != 0:
                raise self._fail(f"put of manifest {manifest_key!r}", rc)
            written.append(manifest_key)
            t2 = time.perf_counter()
        except BaseException:
            self._remove_keys(written, strict=False)  # no half batch stays behind
            raise
        finally:
            self.staging.release(buf)
        # The ref carries a copy of the (small) manifest: a reader skips one store round trip.
        return StoreRef(key=key, backend=self.backend, nbytes=n,
                        handle={"keys": written, "manifest": plan.manifest},
                        timings_ms={"encode_ms": (t1 - t0) * 1e3, "put_ms": (t2 - t0) * 1e3})

    # -- get ---------------------------------------------------------------------------
    def get(self, ref: StoreRef) -> Columns:
        self._check_ref(ref)
        manifest = ref.handle.get("manifest") or self._read_manifest(ref.key)
        n, chunk = manifest["nbytes"], manifest["chunk_bytes"]
        keys = [f"{ref.key}/{i}" for i in range((n + chunk - 1) // chunk)]
        buf = self.receive.acquire(max(n, 1))
        release = functools.partial(self.receive.release, buf)  # then a once-only finalizer
        try:
            if keys:
                sizes = [min(chunk, n - i * chunk) for i in range(len(keys))]
                rcs = self.client.batch_get_into(keys, [buf.ptr + i * chunk for i in range(len(keys))],
                                                 sizes)
                bad = [(k, rc) for k, rc, s in zip(keys, rcs, sizes) if rc != s]
                if bad:
                    found = bad[0][1] != NOT_FOUND
                    gone = "" if found else " (removed already, or the learner holding its segment closed)"
                    raise self._fail(f"get of {bad[0][0]!r}{gone}", bad[0][1] if bad[0][1] < 0 else -10,
                                     StoreError if found else StoreRemovedError)
            t0 = time.perf_counter()
            # the views keep `exporter` alive; when the last one goes, the buffer is reused
            exporter = (ctypes.c_uint8 * max(n, 1)).from_address(buf.ptr)
            # runs at most once: a failed decode below must not release the buffer twice
            # (it would then sit twice in the pool and serve two gets at once)
            release = weakref.finalize(exporter, self.receive.release, buf)
            columns = codec.decode(manifest, exporter)
            self.get_timings_ms = {"decode_ms": (time.perf_counter() - t0) * 1e3}
            return columns
        except BaseException:
            release()
            raise

    def _read_manifest(self, key: str) -> dict:
        raw = self.client.get(f"{key}/manifest")
        if not raw:
            raise StoreRemovedError(f"Mooncake store (master {self.settings.master_server_address}) "
                                    f"has no {key + '/manifest'!r}: removed already, or the learner "
                                    "holding its segment closed")
        return json.loads(raw)

    # -- remove / close ----------------------------------------------------------------
    def remove(self, refs: Sequence[StoreRef]) -> None:
        for ref in refs:
            self._check_ref(ref)
        for ref in refs:
            self._remove_keys(ref.handle["keys"], strict=True)

    def _release(self) -> None:
        self.staging.close()
        self.receive.close()
