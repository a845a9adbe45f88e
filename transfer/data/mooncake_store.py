"""``transfer=mooncake_tcp`` / ``mooncake_rdma``: Mooncake Store as the rollout-data path.

Two codecs behind one ``RolloutStore``:

* ``packed`` (ours): the column dict is laid out by ``transfer.data.codec`` straight into a
  registered staging buffer (the only copy), written in ``chunk_bytes`` chunks with one
  ``batch_put_from``, then the JSON manifest is written **last**, so a reader never sees a
  half batch. ``get`` reads the manifest, pulls every chunk with one ``batch_get_into``
  into a registered receive buffer and returns zero-copy views of it. The receive buffer
  goes back to the pool when the last view is garbage-collected.
* ``bundle``: Mooncake's own ``MooncakeBundleTransfer`` (one key per field buffer), kept
  as the reference to compare with.

Guards for known Mooncake behaviour (measured on 0.3.13.post1):
a second put to an existing key keeps the old value (keys are checked to be new first);
``put(key, ndarray)`` stores ``len`` not ``nbytes`` bytes (we only ``put_from`` byte
ranges); ``remove`` fails inside the lease TTL (we pass ``force=True``); data lives in the
segment of the client that mounted it and vanishes when that client closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from transfer.data import codec
from transfer.data.base import Columns, RemovedError, StoreRef
from transfer.net import port_open

# Mooncake ErrorCode values met on this path (mooncake-store/include/types.h).
_ERRORS = {-10: "BUFFER_OVERFLOW", -200: "NO_AVAILABLE_HANDLE (segments full)",
           -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
           -800: "TRANSFER_FAIL", -900: "RPC_FAIL"}
_NOT_FOUND = -704
SETUP_KEYS = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
              "protocol", "rdma_devices", "master_server_addr", "ipc_socket_path",
              "enable_ssd_offload", "ssd_offload_path", "tenant_id", "enable_client_http_server",
              "client_http_port"}


class StoreError(RuntimeError):
    """A Mooncake Store operation failed."""


class StoreRemovedError(StoreError, RemovedError):
    """A get found no data under the ref's keys: removed already, or the learner holding
    its segment closed."""


def import_mooncake():
    """``mooncake.store``, or an ImportError that says what to install."""
    # Mooncake logs at INFO by default (several lines per client); keep warnings and errors
    # unless the user asks for more. Read when the library loads.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake import store
    except ImportError as e:
        raise explain_import_error(e) from e
    return store


def explain_import_error(e: ImportError) -> ImportError:
    msg = str(e)
    if "libcuda" in msg:
        return ImportError(
            "the installed Mooncake wheel is a CUDA build and needs libcuda.so.1, which this "
            "machine lacks: pip uninstall -y mooncake-transfer-engine mooncake-transfer-engine-cuda13 "
            f"&& pip install mooncake-transfer-engine-non-cuda ({msg})")
    if "libibverbs" in msg:
        return ImportError(f"Mooncake needs libibverbs1: apt-get install -y libibverbs1 ({msg})")
    if "No module named 'mooncake" in msg:
        return ImportError(
            "transfer=mooncake_* needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
            "(machines without CUDA) or mooncake-transfer-engine-cuda13 (CUDA 13 images)")
    return e


@dataclass(frozen=True)
class MooncakeSettings:
    """Connection settings of one client (plain values; the rl config resolves them)."""

    master_server_address: str
    metadata_server: str
    local_hostname: str
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 0
    """Bytes this client contributes to the store (0 = none: producers, drivers)."""
    local_buffer_size: int = 64 << 20
    chunk_bytes: int = 4 << 20
    replica_num: int = 1
    codec: str = "packed"
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``setup`` keys; they override the fields above."""

    def setup_config(self) -> dict[str, Any]:
        cfg = {"local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
               "global_segment_size": self.global_segment_size,
               "local_buffer_size": self.local_buffer_size, "protocol": self.protocol,
               "rdma_devices": self.device_name, "master_server_addr": self.master_server_address}
        cfg.update(self.init_kwargs)
        return cfg


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


class MooncakeStore:
    backend = "mooncake"

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        if settings.codec not in ("packed", "bundle"):
            raise ValueError(f"unknown Mooncake codec {settings.codec!r}; use packed or bundle")
        host, _, port = settings.master_server_address.rpartition(":")
        if not port.isdigit() or not port_open(host, int(port), timeout_s=3.0):
            raise StoreError(
                f"Mooncake master at {settings.master_server_address!r} is unreachable: start one "
                "(python -m transfer.data.mooncake_master --host <ip>) and export MOONCAKE_MASTER "
                "on every node, or leave it unset on a single machine to start one automatically")
        store = import_mooncake()
        self.client = store.MooncakeDistributedStore()
        t0 = time.perf_counter()
        rc = self.client.setup(settings.setup_config())
        if rc != 0:
            raise StoreError(f"Mooncake client setup failed (code {rc}) with master "
                             f"{settings.master_server_address}, metadata {settings.metadata_server}, "
                             f"protocol {settings.protocol!r}, device {settings.device_name!r}")
        self.setup_s = time.perf_counter() - t0
        self.replicate = store.ReplicateConfig()
        self.replicate.replica_num = settings.replica_num
        self.staging = _BufferPool(self.client)
        self.receive = _BufferPool(self.client)
        self._bundle = None
        self.last_decode_ms = 0.0
        self.closed = False

    def _fail(self, what: str, rc: int, error: type[StoreError] = StoreError) -> StoreError:
        name = _ERRORS.get(rc, "error")
        hint = ""
        if rc == -200:
            hint = ("; the store's segments are full: raise transfer.global_segment_size "
                    "(each contributing learner node adds one segment)")
        return error(f"Mooncake store (master {self.settings.master_server_address}): "
                     f"{what} failed with code {rc} {name}{hint}")

    # -- put ---------------------------------------------------------------------------
    def put(self, columns: Columns, *, key: str) -> StoreRef:
        if self.settings.codec == "bundle":
            return self._put_bundle(columns, key)
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
        buf = self.staging.acquire(codec._align(n) + len(manifest))
        written: list[str] = []
        try:
            codec.write(plan, buf.array[:n])
            mptr = buf.ptr + codec._align(n)
            buf.array[codec._align(n):codec._align(n) + len(manifest)] = np.frombuffer(manifest, np.uint8)
            t1 = time.perf_counter()
            if chunk_keys:
                ptrs = [buf.ptr + i * chunk for i in range(len(chunk_keys))]
                sizes = [min(chunk, n - i * chunk) for i in range(len(chunk_keys))]
                rcs = self.client.batch_put_from(chunk_keys, ptrs, sizes, self.replicate)
                written = [k for k, rc in zip(chunk_keys, rcs) if rc == 0]
                bad = [rc for rc in rcs if rc != 0]
                if bad:
                    raise self._fail(f"put of {key!r} ({len(bad)} of {len(rcs)} chunks)", bad[0])
            rc = self.client.put_from(manifest_key, mptr, len(manifest), self.replicate)
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
        if ref.backend != self.backend:
            raise ValueError(f"ref {ref.key!r} was written by {ref.backend!r}, not by mooncake")
        if "bundle" in ref.handle:
            return self._get_bundle(ref)
        manifest = ref.handle.get("manifest") or self._read_manifest(ref.key)
        n, chunk = manifest["nbytes"], manifest["chunk_bytes"]
        keys = [f"{ref.key}/{i}" for i in range((n + chunk - 1) // chunk)]
        buf = self.receive.acquire(max(n, 1))
        try:
            if keys:
                sizes = [min(chunk, n - i * chunk) for i in range(len(keys))]
                rcs = self.client.batch_get_into(keys, [buf.ptr + i * chunk for i in range(len(keys))],
                                                 sizes)
                bad = [(k, rc) for k, rc, s in zip(keys, rcs, sizes) if rc != s]
                if bad:
                    found = bad[0][1] != _NOT_FOUND
                    gone = "" if found else " (removed already, or the learner holding its segment closed)"
                    raise self._fail(f"get of {bad[0][0]!r}{gone}", bad[0][1] if bad[0][1] < 0 else -10,
                                     StoreError if found else StoreRemovedError)
            t0 = time.perf_counter()
            # the views keep `exporter` alive; when the last one goes, the buffer is reused
            exporter = (ctypes.c_uint8 * max(n, 1)).from_address(buf.ptr)
            weakref.finalize(exporter, self.receive.release, buf)
            columns = codec.decode(manifest, exporter)
            self.last_decode_ms = (time.perf_counter() - t0) * 1e3
            return columns
        except BaseException:
            self.receive.release(buf)
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
            if ref.backend != self.backend:
                raise ValueError(f"ref {ref.key!r} was written by {ref.backend!r}, not by mooncake")
            if "bundle" in ref.handle:
                self._remove_bundle(ref)
            else:
                self._remove_keys(ref.handle["keys"], strict=True)

    def _remove_keys(self, keys: list[str], strict: bool) -> None:
        if not keys:
            return
        # force: a key is leased for a while after each read; remove may not wait for it
        rcs = self.client.batch_remove(list(keys), True)
        bad = [(k, rc) for k, rc in zip(keys, rcs) if rc not in (0, _NOT_FOUND)]
        if bad and strict:
            raise self._fail(f"remove of {bad[0][0]!r}", bad[0][1])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.staging.close()
        self.receive.close()
        self.client.close()

    # -- Mooncake's own bundle codec (the reference) -----------------------------------------
    @property
    def bundle(self):
        if self._bundle is None:
            from mooncake.structured_object_store import MooncakeBundleTransfer

            self._bundle = MooncakeBundleTransfer(self.client, key_prefix="rl",
                                                  default_chunk_bytes=self.settings.chunk_bytes)
        return self._bundle

    def _put_bundle(self, columns: Columns, key: str) -> StoreRef:
        from mooncake.structured_object_store import export_dataproto_ref

        t0 = time.perf_counter()
        try:
            # bundle partitions allow no '/'; our keys use it as the namespace separator
            ref = self.bundle.put(dict(columns), type="dict", namespace="rl",
                                  partition=re.sub(r"[^A-Za-z0-9_.-]", "_", key),
                                  config=self.replicate)
        except ValueError as e:
            hint = (" (the bundle API needs one row per sample in every column; codec=packed "
                    "has no such limit)") if "batch size" in str(e) else ""
            raise StoreError(f"transfer.codec=bundle cannot store {key!r}: {e}{hint}") from e
        put_ms = (time.perf_counter() - t0) * 1e3
        from transfer.data.base import columns_nbytes

        return StoreRef(key=key, backend=self.backend, nbytes=columns_nbytes(columns),
                        handle={"bundle": export_dataproto_ref(ref), "order": list(columns)},
                        timings_ms={"put_ms": put_ms, "encode_ms": 0.0})

    def _get_bundle(self, ref: StoreRef) -> Columns:
        t0 = time.perf_counter()
        try:
            out = self.bundle.get(ref.handle["bundle"], type="dict")
        except (KeyError, FileNotFoundError, json.JSONDecodeError) as e:  # its metadata is gone
            raise StoreRemovedError(f"Mooncake store (master {self.settings.master_server_address}): "
                                    f"get of bundle {ref.key!r}: removed already, or the learner "
                                    f"holding its segment closed ({type(e).__name__}: {e})") from e
        self.last_decode_ms = (time.perf_counter() - t0) * 1e3
        return {name: _plain(out[name]) for name in ref.handle["order"]}

    def _remove_bundle(self, ref: StoreRef) -> None:
        try:
            self.bundle.cleanup_dataproto(ref.handle["bundle"])
        except (KeyError, FileNotFoundError):
            pass  # removed already


def _plain(value: Any) -> Any:
    """Bundle results as plain ndarrays and lists (its pool-backed subclasses cannot be
    pickled); views, so the pool lease stays alive as long as they do."""
    if isinstance(value, np.ndarray):
        return value.view(np.ndarray)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
