"""``transfer`` group: the rollout-data path (learners read what the manager puts).

Each backend's schema starts what the backend needs on the driver (``start_services``) and
builds a store client in each process (``build``), importing the backend lazily. Mooncake's
bootstrap (environment checks, capacity, the local master) lives next to the master it
starts, in ``transfer.data.mooncake_bootstrap``; this schema only hands it the fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from rl.config.checks import parse_size

if TYPE_CHECKING:
    from rl.runtime import Runtime
    from transfer.data.base import RolloutStore


@dataclass(kw_only=True)
class TransferConfig:
    _group = "transfer"
    name: str = MISSING
    """Backend of the rollout-data path."""

    def start_services(self, runtime: "Runtime", num_nodes: int, bytes_per_step: int,
                       batches_held: int = 1) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
        """Driver side, before any worker starts: check the environment, start what the
        backend needs (a local master). ``batches_held``: rollout batches the store holds at
        once (1 for train.py, more when generation runs ahead). Returns settings for
        ``runtime.transfer`` and a stop function."""
        return {}, None

    def check_environment(self, num_nodes: int, bytes_per_step: int, batches_held: int = 1) -> None:
        """Driver side, before Ray starts when the run starts its own one-node Ray
        (``rl.cluster._starts_local_ray``): refuse an environment the backend cannot work in, so
        that the error comes in seconds. Needs no Ray; ``start_services`` still runs after."""

    def build(self, runtime: "Runtime", *, contribute_segment: bool = False) -> "RolloutStore":
        """A store client for this process; ``contribute_segment``: it lends memory to the
        store (learner local rank 0 only)."""
        raise NotImplementedError

    node_env: ClassVar[tuple[str, ...]] = ()
    """Environment variables the backend's clients read on their own node (exported there
    before ``ray start``); on several nodes the driver reads them from each node first."""

    def check_node_env(self, node: str, env: dict[str, str], num_nodes: int) -> None:
        """Driver side, before any worker starts: refuse what ``node`` exports (``env``: its
        values of ``node_env``) if the backend cannot work with it."""


@dataclass(kw_only=True)
class RayTransferConfig(TransferConfig):
    name: str = "ray"

    def build(self, runtime: "Runtime", *, contribute_segment: bool = False) -> "RolloutStore":
        from transfer.data.ray_store import RayStore

        return RayStore()


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
    """``tcp`` or ``rdma``; unset = env MOONCAKE_PROTOCOL, else tcp."""
    device_name: Optional[str] = None
    """RDMA device(s), e.g. ``mlx5_0``; unset = env MOONCAKE_DEVICE (read on each node)."""
    global_segment_size: Any = "1gb"
    """Memory each contributing client (learner local rank 0) lends to the store."""
    local_buffer_size: Any = "64mb"
    """Client-side transfer buffer of every client."""
    chunk_bytes: Any = "4mb"
    """Largest single object; payloads are split into chunks of this size."""
    replica_num: int = 1
    """Copies of every object (on different segments)."""
    codec: str = "packed"
    """``packed`` (ours: one registered buffer, chunked) or ``bundle`` (MooncakeBundleTransfer)."""
    init_kwargs: Any = None
    """Extra client ``setup`` keys, a mapping or a JSON string; they win over the fields above."""
    master_start_timeout_s: float = 15.0
    """Bound on a locally started master becoming ready."""

    def __post_init__(self) -> None:
        from transfer.data.mooncake_bootstrap import PROTOCOLS, parse_init_kwargs

        for f in ("global_segment_size", "local_buffer_size", "chunk_bytes"):
            setattr(self, f, parse_size(getattr(self, f), f"transfer.{f}"))
        if self.chunk_bytes <= 0:
            raise ValueError("transfer.chunk_bytes must be > 0")
        if self.global_segment_size < 16 << 20:  # Mooncake refuses smaller segments
            raise ValueError(f"transfer.global_segment_size={self.global_segment_size} bytes is "
                             "below Mooncake's minimum of 16mb")
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ValueError(f"transfer.protocol={self.protocol!r}: use tcp or rdma")
        if self.codec not in ("packed", "bundle"):
            raise ValueError(f"transfer.codec={self.codec!r}: use packed or bundle")
        if self.replica_num < 1:
            raise ValueError(f"transfer.replica_num={self.replica_num} must be >= 1")
        if isinstance(self.init_kwargs, DictConfig):
            self.init_kwargs = OmegaConf.to_container(self.init_kwargs)
        self.init_kwargs = parse_init_kwargs(self.init_kwargs)

    def _checked(self) -> dict[str, Any]:
        """The fields ``mooncake_bootstrap.preflight`` checks (``start_services`` too)."""
        return dict(master_server_address=self.master_server_address, local_hostname=self.local_hostname,
                    protocol=self.protocol, device_name=self.device_name,
                    global_segment_size=self.global_segment_size, replica_num=self.replica_num)

    def check_environment(self, num_nodes: int, bytes_per_step: int, batches_held: int = 1) -> None:
        from transfer.data import mooncake_bootstrap

        mooncake_bootstrap.preflight(num_nodes=num_nodes, bytes_per_step=bytes_per_step,
                                     batches_held=batches_held, **self._checked())

    def start_services(self, runtime: "Runtime", num_nodes: int, bytes_per_step: int,
                       batches_held: int = 1) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
        from transfer.data import mooncake_bootstrap

        return mooncake_bootstrap.start_services(
            log_dir=runtime.log_dir, num_nodes=num_nodes, bytes_per_step=bytes_per_step,
            batches_held=batches_held, metadata_server=self.metadata_server,
            master_start_timeout_s=self.master_start_timeout_s, **self._checked())

    node_env: ClassVar[tuple[str, ...]] = ("MOONCAKE_LOCAL_HOSTNAME",)

    def check_node_env(self, node: str, env: dict[str, str], num_nodes: int) -> None:
        from transfer.data.mooncake_bootstrap import check_announced_hostname

        if self.local_hostname is None:  # the field wins over every node's environment
            check_announced_hostname(env.get("MOONCAKE_LOCAL_HOSTNAME"), num_nodes=num_nodes,
                                     where=f"MOONCAKE_LOCAL_HOSTNAME on node {node}")

    def build(self, runtime: "Runtime", *, contribute_segment: bool = False) -> "RolloutStore":
        from rl.runtime import node_ip
        from transfer.data.mooncake_bootstrap import client_settings
        from transfer.data.mooncake_client import open_store

        settings = client_settings(
            runtime.transfer, default_hostname=node_ip(), local_hostname=self.local_hostname,
            protocol=self.protocol, device_name=self.device_name,
            global_segment_size=self.global_segment_size if contribute_segment else 0,
            local_buffer_size=self.local_buffer_size, chunk_bytes=self.chunk_bytes,
            replica_num=self.replica_num, codec=self.codec, init_kwargs=self.init_kwargs)
        return open_store(settings)


SCHEMAS: dict[str, type] = {"ray": RayTransferConfig, "mooncake": MooncakeTransferConfig}
"""Schema of each backend (``schema/transfer/<key>``; ``mooncake_tcp``/``mooncake_rdma``
both extend ``mooncake``)."""

BACKENDS: dict[str, list[str]] = {
    "ray": ["transfer=ray"],
    "mooncake-packed": ["transfer=mooncake_tcp"],
    "mooncake-bundle": ["transfer=mooncake_tcp", "transfer.codec=bundle"],
}
"""Every data path worth comparing, by label, as the overrides that choose it: the store
conformance suite (``tests/store_suite.py``), the train_async.py matrix and the transfer
benchmark run each one, built from ``rl.config.compose(*overrides).transfer`` as train.py
builds it. A new backend adds its entry here (docs/transfer.md, "Adding a backend")."""
