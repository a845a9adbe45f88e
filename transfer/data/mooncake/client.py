"""What both Mooncake stores share: the wheel import, one client's settings and their
checks, its connection to the master, error codes turned into messages, and removing keys.

The base class knows no codec: the stores (``packed``, ``bundle``) subclass it, and
``transfer.data.mooncake.open_store`` picks one by ``settings.codec``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from transfer.data.base import RemovedError
from transfer.net import port_open
from transfer.units import parse_size

# Mooncake ErrorCode values met on this path (mooncake-store/include/types.h).
_ERRORS = {-10: "BUFFER_OVERFLOW", -200: "NO_AVAILABLE_HANDLE (segments full)",
           -704: "OBJECTNOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
           -800: "TRANSFER_FAIL", -900: "RPC_FAIL"}
NOT_FOUND = -704
PROTOCOLS = ("tcp", "rdma")
SETUP_KEYS = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
              "protocol", "rdma_devices", "master_server_addr", "ipc_socket_path",
              "enable_ssd_offload", "ssd_offload_path", "tenant_id", "enable_client_http_server",
              "client_http_port"}


SETUP_NOISE = ("Logging before InitGoogleLogging()", "metadata not found",
               "Failed to retrieve segment descriptor")
"""What every client's setup logs about its own segment before registering it (0.3.13: an
error-level "metadata not found" and a warning per client): no failure, so not shown."""


@contextmanager
def stderr_without(noise: tuple[str, ...]) -> Iterator[None]:
    """Pass through what the process writes to file descriptor 2 meanwhile (C++ logs bypass
    ``sys.stderr``) except the lines containing one of ``noise``."""
    read_fd, write_fd = os.pipe()
    saved = os.dup(2)
    kept: list[bytes] = []

    def drain() -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            kept.extend(line for line in pipe if not any(n.encode() in line for n in noise))

    reader = threading.Thread(target=drain, name="stderr-filter", daemon=True)
    reader.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees its end
        os.close(saved)
        reader.join(timeout=5)
        for line in kept:
            os.write(2, line)


class StoreError(RuntimeError):
    """A Mooncake Store operation failed."""


class StoreRemovedError(StoreError, RemovedError):
    """A get found no data under the ref's keys: removed already, or the learner holding
    its segment closed."""


def import_mooncake():
    """``mooncake.store`` (an optional dependency: imported here, by the first client or the
    driver's preflight), or an ImportError that says what to install."""
    # Mooncake logs at INFO by default (several lines per client); keep warnings and errors
    # unless the user asks for more. Read when the library loads.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    # Its TCP transport opens a connection per transfer request unless pooled (read when the
    # transfer engine starts); a user's own value wins. Measured in docs/benchmarks.md.
    os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "1")
    try:  # optional dependency
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
    """Connection settings of one client (plain values; ``bootstrap.client_settings`` resolves
    them from the config's fields and the ``MOONCAKE_*`` variables)."""

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
    """``packed`` (``MooncakeStore``) or ``bundle`` (``MooncakeBundleStore``); see
    ``transfer.data.mooncake.open_store``."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``setup`` keys; they override the fields above."""

    def setup_config(self) -> dict[str, Any]:
        cfg = {"local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
               "global_segment_size": self.global_segment_size,
               "local_buffer_size": self.local_buffer_size, "protocol": self.protocol,
               "rdma_devices": self.device_name, "master_server_addr": self.master_server_address}
        cfg.update(self.init_kwargs)
        return cfg


def parse_init_kwargs(value: Any) -> dict[str, Any]:
    """Extra client ``setup`` keys, a mapping or a JSON string -> a checked dict (sizes in bytes)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"transfer.init_kwargs is not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"transfer.init_kwargs must be a mapping or a JSON object, got {value!r}")
    unknown = sorted(set(value) - SETUP_KEYS)
    if unknown:
        raise ValueError(f"transfer.init_kwargs: unknown Mooncake setup keys {unknown}; "
                         f"known: {sorted(SETUP_KEYS)}")
    out = dict(value)
    for k in ("global_segment_size", "local_buffer_size"):
        if k in out:
            out[k] = parse_size(out[k], f"transfer.init_kwargs.{k}")
    for k in ("enable_ssd_offload", "enable_client_http_server"):
        if k in out and not isinstance(out[k], bool):
            raise ValueError(f"transfer.init_kwargs.{k}={out[k]!r} must be true or false")
    if "client_http_port" in out and (isinstance(out["client_http_port"], bool)
                                      or not isinstance(out["client_http_port"], int)):
        raise ValueError(f"transfer.init_kwargs.client_http_port={out['client_http_port']!r} "
                         "must be an integer")
    return out


def require_master(address: str) -> None:
    """Raise a ``StoreError`` saying what to start when no master answers at ``address``."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not port_open(host, int(port), timeout_s=3.0):
        raise StoreError(
            f"Mooncake master at {address!r} is unreachable: start one "
            "(python -m transfer.data.mooncake.master --host <ip>) and export MOONCAKE_MASTER "
            "on every node, or leave it unset on a single machine to start one automatically")


class MooncakeClient:
    """One connected ``MooncakeDistributedStore`` and what every codec does with it."""

    backend = "mooncake"
    codec = ""
    """The ``settings.codec`` this class implements."""

    def __init__(self, settings: MooncakeSettings) -> None:
        if settings.codec != self.codec:
            raise ValueError(f"{type(self).__name__} implements codec {self.codec!r}, the settings ask "
                             f"for {settings.codec!r}: build stores with open_store(settings)")
        self.settings = settings
        require_master(settings.master_server_address)
        store = import_mooncake()
        self.client = store.MooncakeDistributedStore()
        with stderr_without(SETUP_NOISE):
            rc = self.client.setup(settings.setup_config())
        if rc != 0:
            raise StoreError(f"Mooncake client setup failed (code {rc}) with master "
                             f"{settings.master_server_address}, metadata {settings.metadata_server}, "
                             f"protocol {settings.protocol!r}, device {settings.device_name!r}")
        self._replicate_config = store.ReplicateConfig
        # the segment this client lends is named by its host and transfer port ("ip:port")
        self.location = self.client.get_hostname() if settings.global_segment_size else None
        self.get_timings_ms: dict[str, float] = {}
        self.closed = False

    def replicate_near(self, near: str | None):
        """The put's ``ReplicateConfig``: ``replica_num`` copies, the first in segment ``near``
        (a reader's ``location``) when given, so that reader copies it locally instead of
        pulling it over the network or loopback TCP. ``preferred_segments`` (a list;
        the single ``preferred_segment`` is marked deprecated upstream). A segment too full
        for the put is passed over for another by the master, silently: the capacity check at
        start sizes every rank's segment for the batches the store holds."""
        config = self._replicate_config()
        config.replica_num = self.settings.replica_num
        if near:
            config.preferred_segments = [near]
        return config

    def _check_ref(self, ref) -> None:
        if ref.backend != self.backend:
            raise ValueError(f"ref {ref.key!r} was written by {ref.backend!r}, not by {self.backend}")

    def _fail(self, what: str, rc: int, error: type[StoreError] = StoreError) -> StoreError:
        name = _ERRORS.get(rc, "error")
        hint = ""
        if rc == -200:
            hint = ("; the store's segments are full: raise transfer.global_segment_size "
                    "(each contributing learner node adds one segment)")
        return error(f"Mooncake store (master {self.settings.master_server_address}): "
                     f"{what} failed with code {rc} {name}{hint}")

    def _remove_keys(self, keys: list[str], strict: bool) -> None:
        if not keys:
            return
        # force: a key is leased for a while after each read; remove may not wait for it
        rcs = self.client.batch_remove(list(keys), True)
        bad = [(k, rc) for k, rc in zip(keys, rcs) if rc not in (0, NOT_FOUND)]
        if bad and strict:
            raise self._fail(f"remove of {bad[0][0]!r}", bad[0][1])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._release()
        self.client.close()

    def _release(self) -> None:
        """Codec-specific cleanup before the client closes."""

