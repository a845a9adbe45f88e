"""``transfer=mooncake_tcp`` / ``mooncake_rdma`` with ``transfer.codec=packed`` (the default):
our codec over Mooncake Store; ``transfer.codec=pickle`` moves the pickled column dict the
same way (``MooncakePickleStore``), to measure the codec apart from the transport.

The column dict is laid out by ``transfer.data.codec`` straight into a registered staging
buffer (the only copy) and written in ``chunk_bytes`` chunks with one ``batch_put_from``:
the put is that one batch, nothing else. The small JSON manifest travels in the
``StoreRef``, not through the store. ``get`` pulls every chunk with one ``batch_get_into``
into a registered receive buffer and returns zero-copy views of it; the buffer goes back to
the pool when the last view is garbage-collected.

Guards for known Mooncake behaviour (measured on 0.3.13.post1):
a second put to an existing key keeps the old value (every put writes under a fresh random
suffix of its key, so no key is written twice and none has to be checked first);
``put(key, ndarray)`` stores ``len`` not ``nbytes`` bytes (we only ``put_from`` byte
ranges); ``remove`` fails inside the lease TTL (we pass ``force=True``); data lives in the
segment of the client that mounted it and vanishes when that client closes.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import pickle
import secrets
import threading
import time
import weakref
from typing import Callable, Sequence

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


WAIT_NICE_ENV = "RL_MOONCAKE_WAIT_NICE"
"""Measurement switch, off by default: how much to raise the nice value of a thread that
makes the transfer calls. The wheels are built without event-driven completion, so the calling thread polls
until the transfer is done (mooncake-store ``TransferEngineOperationState::
wait_for_completion``); raising that thread's nice value lets the engine's own threads win
a contended core. Measured with no gain (docs/benchmarks.md, "Mooncake's waiting thread"),
so it stays off."""


class _NicedThread:
    """Runs calls in one thread whose nice value is raised (Linux sets nice per thread)."""

    def __init__(self, nice: int) -> None:
        def lower() -> None:  # relative to the process's own nice value
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))

        self.pool = concurrent.futures.ThreadPoolExecutor(1, "mooncake-wait", initializer=lower)

    def call(self, fn, *args):
        return self.pool.submit(fn, *args).result()


class MooncakeStore(MooncakeClient):
    """The packed codec (one registered buffer per batch, chunked)."""

    codec = "packed"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        self.staging = _BufferPool(self.client)
        self.receive = _BufferPool(self.client)
        nice = int(os.environ.get(WAIT_NICE_ENV, "0"))
        self._waiter = _NicedThread(nice) if nice else None

    def _run(self, fn, *args):
        """A transfer call, in the calling thread or (measurement switch) the niced one."""
        return self._waiter.call(fn, *args) if self._waiter else fn(*args)

    # -- the codec: how columns become bytes and back ----------------------------------
    def _layout(self, columns: Columns) -> tuple[dict, Callable[[np.ndarray], None]]:
        """The manifest (``nbytes`` at least) and a function that writes the payload into a
        uint8 array of that size."""
        plan = codec.plan(columns)
        return plan.manifest, functools.partial(codec.write, plan)

    def _decode(self, manifest: dict, payload) -> Columns:
        return codec.decode(manifest, payload)

    # -- put ---------------------------------------------------------------------------
    def put(self, columns: Columns, *, key: str, near: str | None = None) -> StoreRef:
        t0 = time.perf_counter()
        manifest, write = self._layout(columns)
        n, chunk = manifest["nbytes"], self.settings.chunk_bytes
        manifest["chunk_bytes"] = chunk
        # Unique per put: a put to an existing key keeps the old value, and checking first
        # costs a round trip to the master on every put.
        prefix = f"{key}/{secrets.token_hex(6)}"
        chunk_keys = [f"{prefix}/{i}" for i in range((n + chunk - 1) // chunk)]
        buf = self.staging.acquire(max(n, 1))
        written: list[str] = []
        try:
            write(buf.array[:n])
            t1 = time.perf_counter()
            if chunk_keys:
                ptrs = [buf.ptr + i * chunk for i in range(len(chunk_keys))]
                sizes = [min(chunk, n - i * chunk) for i in range(len(chunk_keys))]
                rcs = self._run(self.client.batch_put_from, chunk_keys, ptrs, sizes,
                                self.replicate_near(near))
                written = [k for k, rc in zip(chunk_keys, rcs) if rc == 0]
                bad = [rc for rc in rcs if rc != 0]
                if bad:
                    raise self._fail(f"put of {key!r} ({len(bad)} of {len(rcs)} chunks)", bad[0])
            t2 = time.perf_counter()
        except BaseException:
            self._remove_keys(written, strict=False)  # no half batch stays behind
            raise
        finally:
            self.staging.release(buf)
        # The (small) manifest travels in the ref, never through the store: a reader holds it
        # before it reads, and the put is one batch of chunk writes.
        return StoreRef(key=key, backend=self.backend, nbytes=n,
                        handle={"keys": written, "manifest": manifest},
                        timings_ms={"encode_ms": (t1 - t0) * 1e3, "put_ms": (t2 - t0) * 1e3})

    # -- get ---------------------------------------------------------------------------
    def get(self, ref: StoreRef) -> Columns:
        self._check_ref(ref)
        manifest, keys = ref.handle["manifest"], ref.handle["keys"]
        n, chunk = manifest["nbytes"], manifest["chunk_bytes"]
        buf = self.receive.acquire(max(n, 1))
        release = functools.partial(self.receive.release, buf)  # then a once-only finalizer
        try:
            if keys:
                sizes = [min(chunk, n - i * chunk) for i in range(len(keys))]
                rcs = self._run(self.client.batch_get_into, keys,
                                [buf.ptr + i * chunk for i in range(len(keys))], sizes)
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
            columns = self._decode(manifest, exporter)
            self.get_timings_ms = {"decode_ms": (time.perf_counter() - t0) * 1e3}
            return columns
        except BaseException:
            release()
            raise

    # -- remove / close ----------------------------------------------------------------
    def remove(self, refs: Sequence[StoreRef]) -> None:
        for ref in refs:
            self._check_ref(ref)
        for ref in refs:
            self._remove_keys(ref.handle["keys"], strict=True)

    def _release(self) -> None:
        if self._waiter is not None:
            self._waiter.pool.shutdown()
        self.staging.close()
        self.receive.close()


class MooncakePickleStore(MooncakeStore):
    """``transfer.codec=pickle``: the column dict pickled (protocol 5, arrays in-band) and moved
    like the packed payload, so the codec can be compared apart from the transport. Reading
    copies every array out of the receive buffer (``pickle.loads``), which then goes back to
    the pool at once. Unpickling runs code from the store: a measurement baseline, not a
    default."""

    backend = "mooncake-pickle"
    codec = "pickle"

    def _layout(self, columns: Columns) -> tuple[dict, Callable[[np.ndarray], None]]:
        blob = pickle.dumps(columns, protocol=5)

        def write(dst: np.ndarray) -> None:
            dst[:] = np.frombuffer(blob, dtype=np.uint8)

        return {"nbytes": len(blob)}, write

    def _decode(self, manifest: dict, payload) -> Columns:
        return pickle.loads(memoryview(payload)[:manifest["nbytes"]])
