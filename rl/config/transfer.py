"""``transfer`` group: the rollout-data path (learners read what the manager puts).

Values and their checks only. What checks, starts and builds each backend sits beside the
backend (``transfer/data/ray_store.py``, the ``transfer/data/mooncake/`` package), and
``rl.backends`` joins a schema here to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from rl.config.checks import parse_size
from transfer.data.mooncake import CODECS
from transfer.data.mooncake.client import PROTOCOLS, parse_init_kwargs
from transfer.data.ray_store import CODECS as RAY_CODECS


@dataclass(kw_only=True)
class TransferConfig:
    _group = "transfer"
    name: str = MISSING
    """Backend of the rollout-data path."""


@dataclass(kw_only=True)
class RayTransferConfig(TransferConfig):
    name: str = "ray"
    codec: str = "pickle"
    """``pickle`` (the column dict as Ray pickles it, protocol 5: each array one out-of-band
    buffer, which for the flat rollout columns is a few buffers) or ``packed`` (our codec:
    one contiguous buffer, read zero-copy). Pickle is the default: on the flat columns it
    beat packed on one host and on two (docs/benchmarks.md, "The codec apart from the
    transport"), because Ray copies each out-of-band buffer once where packed copies twice."""

    def __post_init__(self) -> None:
        if self.codec not in RAY_CODECS:
            raise ValueError(f"transfer.codec={self.codec!r}: transfer=ray takes {' or '.join(RAY_CODECS)}")


@dataclass(kw_only=True)
class MooncakeTransferConfig(TransferConfig):
    name: str = "mooncake_tcp"
    master_server_address: Optional[str] = None
    """Mooncake master ``host:port``; unset = env MOONCAKE_MASTER, else a local master is started
    (single machine only)."""
    metadata_server: Optional[str] = None
    """HTTP metadata server URL; unset = env MOONCAKE_METADATA_SERVER, else
    ``http://<master host>:8080/metadata`` (the master's built-in one)."""
    local_hostname: Optional[str] = None
    """Address this client is reached at; unset = env MOONCAKE_LOCAL_HOSTNAME, else the Ray node IP."""
    protocol: Optional[str] = None
    """``tcp`` or ``rdma`` (``mooncake_tcp`` and ``mooncake_rdma`` set it); unset = env
    MOONCAKE_PROTOCOL, else tcp. The variable never overrides a set value."""
    device_name: Optional[str] = None
    """RDMA device(s), e.g. ``mlx5_0``; unset = env MOONCAKE_DEVICE (read on each node)."""
    global_segment_size: Any = "1gb"
    """Memory each learner rank lends to the store: the segment its own partitions are put in
    (it must hold that rank's partition of every batch held at once)."""
    local_buffer_size: Any = "64mb"
    """Client-side transfer buffer of every client."""
    chunk_bytes: Any = "4mb"
    """Largest single object; payloads are split into chunks of this size."""
    replica_num: int = 1
    """Copies of every object (on different segments)."""
    codec: str = "packed"
    """``packed`` (ours: one registered buffer, chunked), ``pickle`` (the pickled column dict over
    the same path, to compare codecs) or ``bundle`` (Mooncake's MooncakeBundleTransfer)."""
    init_kwargs: Any = None
    """Extra client ``setup`` keys, a mapping or a JSON string; they win over the fields above."""
    master_start_timeout_s: float = 15.0
    """Bound on a locally started master becoming ready."""

    def __post_init__(self) -> None:
        for f in ("global_segment_size", "local_buffer_size", "chunk_bytes"):
            setattr(self, f, parse_size(getattr(self, f), f"transfer.{f}"))
        if self.chunk_bytes <= 0:
            raise ValueError("transfer.chunk_bytes must be > 0")
        if self.global_segment_size < 16 << 20:  # Mooncake refuses smaller segments
            raise ValueError(f"transfer.global_segment_size={self.global_segment_size} bytes is "
                             "below Mooncake's minimum of 16mb")
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ValueError(f"transfer.protocol={self.protocol!r}: use {' or '.join(PROTOCOLS)}")
        if self.codec not in CODECS:
            raise ValueError(f"transfer.codec={self.codec!r}: use {' or '.join(CODECS)}")
        if self.replica_num < 1:
            raise ValueError(f"transfer.replica_num={self.replica_num} must be >= 1")
        if isinstance(self.init_kwargs, DictConfig):
            self.init_kwargs = OmegaConf.to_container(self.init_kwargs)
        self.init_kwargs = parse_init_kwargs(self.init_kwargs)


SCHEMAS: dict[str, type] = {"ray": RayTransferConfig, "mooncake": MooncakeTransferConfig}
"""Schema of each backend (``schema/transfer/<key>``; ``mooncake_tcp``/``mooncake_rdma``
both extend ``mooncake``)."""

BACKENDS: dict[str, list[str]] = {
    "ray-pickle": ["transfer=ray"],
    "ray-packed": ["transfer=ray", "transfer.codec=packed"],
    "mooncake-pickle": ["transfer=mooncake_tcp", "transfer.codec=pickle"],
    "mooncake-packed": ["transfer=mooncake_tcp"],
    "mooncake-bundle": ["transfer=mooncake_tcp", "transfer.codec=bundle"],
}
"""Every data path worth comparing, by label, as the overrides that choose it: the store
conformance suite (``tests/support/store_suite.py``), the train_async.py matrix and the transfer
benchmark run each one, built from ``rl.config.compose(*overrides).transfer`` by
``rl.backends.data_path`` as train.py builds it. A new backend adds its entry here
(docs/transfer.md, "Adding a backend")."""
