"""The one place where a config choice meets the code that builds it, for both data paths.

The schemas in ``rl.config.transfer`` and ``rl.config.weights`` are data. The backends in
``transfer/`` check, start and build themselves from plain values and import nothing from
``rl`` (docs/architecture.md, "Layers"): ``transfer.data.ray_store``, the ``transfer.data.mooncake``
package (``bootstrap`` on the driver, ``open_store`` in each process), and the senders in
``transfer.weights``. This module reads a config object and the run's ``Runtime``, and hands
those backends the values. It sits on the ``rl`` side because it reads ``rl`` types, and it
is one module so that the mapping stays in one place: configs start nothing
and ``transfer`` never learns what an ``rl`` config is.

``DATA_PATHS`` and ``WEIGHT_PATHS`` map each schema class to its adapter, by class and not
by the ``name`` field (``mooncake_tcp`` and ``mooncake_rdma`` share one schema); a new
backend adds one entry (docs/transfer.md, "Adding a backend"). Which data paths the tests
and benchmarks run is another list, ``rl.config.transfer.BACKENDS`` (labels -> overrides).

A rollout-data path, in call order (driver first, then every process that moves data)::

    path = data_path(cfg.transfer)
    path.check_environment(num_nodes, partition_bytes, batches_held)  # driver, before its own Ray
    path.check_node_env(node, env, num_nodes)     # driver, per node: its values of path.node_env
    services, stop = path.start_services(runtime, num_nodes, partition_bytes, batches_held)
    store = path.build(runtime, contribute_segment=...)   # runtime.transfer = services

A weight path: ``weight_path(cfg.weights).describe_plan(...)`` on the driver,
``.build(...)`` on each learner rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from rl.config.transfer import MooncakeTransferConfig, RayTransferConfig, TransferConfig
from rl.config.weights import BroadcastWeightsConfig, P2PWeightsConfig, WeightsConfig
from rl.runtime import Runtime, node_ip
from transfer.data.base import RolloutStore
from transfer.data.mooncake import bootstrap, open_store
from transfer.data.ray_store import RayStore

if TYPE_CHECKING:
    from transfer.weights.base import WeightReceiver, WeightSync


class DataPath:
    """One rollout-data backend as the driver and the workers use it. The defaults check
    nothing and start nothing."""

    node_env: tuple[str, ...] = ()
    """Environment variables the backend's clients read on their own node (exported there
    before ``ray start``); on several nodes the driver reads them from each node first."""

    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg

    def check_environment(self, num_nodes: int, partition_bytes: int, batches_held: int = 1) -> None:
        """Driver side, before a run's own one-node Ray starts: refuse an environment the
        backend cannot work in, in seconds. ``start_services`` still runs after."""

    def check_node_env(self, node: str, env: Mapping[str, str], num_nodes: int) -> None:
        """Driver side, before any worker starts: refuse what ``node`` exports (``env``: its
        values of ``node_env``) if the backend cannot work with it."""

    def start_services(self, runtime: Runtime, num_nodes: int, partition_bytes: int,
                       batches_held: int = 1) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
        """Driver side, before any worker starts: check, then start what the backend needs.
        ``batches_held``: rollout batches the store holds at once (1 for train.py, more when
        generation runs ahead). Returns the settings for ``runtime.transfer`` and a stop
        function."""
        return {}, None

    def build(self, runtime: Runtime, *, contribute_segment: bool = False) -> RolloutStore:
        """A store client for this process; ``contribute_segment``: it lends memory to the
        store (every learner rank: its partitions are put there)."""
        raise NotImplementedError


class RayDataPath(DataPath):
    def build(self, runtime: Runtime, *, contribute_segment: bool = False) -> RolloutStore:
        return RayStore(self.cfg.codec)


class MooncakeDataPath(DataPath):
    cfg: MooncakeTransferConfig
    node_env = bootstrap.NODE_ENV

    def _checked(self) -> dict:
        """The fields ``bootstrap.preflight`` checks (``start_services`` too)."""
        c = self.cfg
        return dict(master_server_address=c.master_server_address, local_hostname=c.local_hostname,
                    protocol=c.protocol, device_name=c.device_name,
                    global_segment_size=c.global_segment_size, replica_num=c.replica_num)

    def check_environment(self, num_nodes: int, partition_bytes: int, batches_held: int = 1) -> None:
        bootstrap.preflight(num_nodes=num_nodes, partition_bytes=partition_bytes,
                            batches_held=batches_held, **self._checked())

    def check_node_env(self, node: str, env: Mapping[str, str], num_nodes: int) -> None:
        bootstrap.check_node_env(node, env, local_hostname=self.cfg.local_hostname, num_nodes=num_nodes)

    def start_services(self, runtime: Runtime, num_nodes: int, partition_bytes: int,
                       batches_held: int = 1) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
        return bootstrap.start_services(
            log_dir=runtime.log_dir, num_nodes=num_nodes, partition_bytes=partition_bytes,
            batches_held=batches_held, metadata_server=self.cfg.metadata_server,
            master_start_timeout_s=self.cfg.master_start_timeout_s, **self._checked())

    def build(self, runtime: Runtime, *, contribute_segment: bool = False) -> RolloutStore:
        c = self.cfg
        return open_store(bootstrap.client_settings(
            runtime.transfer, default_hostname=node_ip(), local_hostname=c.local_hostname,
            protocol=c.protocol, device_name=c.device_name,
            global_segment_size=c.global_segment_size if contribute_segment else 0,
            local_buffer_size=c.local_buffer_size, chunk_bytes=c.chunk_bytes,
            replica_num=c.replica_num, codec=c.codec, init_kwargs=c.init_kwargs))


class WeightPath:
    """One weight path: the sender each learner rank builds, and the plan it follows.

    ``transfer.weights`` imports torch (about 1.4 s here), which the driver never needs: the
    senders are imported where they are built, in the learner ranks."""

    def __init__(self, cfg: WeightsConfig) -> None:
        self.cfg = cfg

    def describe_plan(self, num_learners: int, receivers: Sequence["WeightReceiver"]) -> str:
        """Which learner rank sends to which engine (printed at start, saved in the run dir)."""
        raise NotImplementedError

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        """This learner rank's sender; ``master_address``: this rank's node address."""
        raise NotImplementedError

    def _sender_kwargs(self, on_gpu: bool, device: str) -> dict:
        c = self.cfg
        return dict(bucket_bytes=c.bucket_bytes, backend=c.resolved_backend(on_gpu),
                    timeout_s=c.timeout_s, device=device)


class BroadcastWeightPath(WeightPath):
    def describe_plan(self, num_learners: int, receivers: Sequence["WeightReceiver"]) -> str:
        return "learner 0 -> " + ", ".join(r.name for r in receivers)

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        from transfer.weights.broadcast import BroadcastSync  # torch: see WeightPath

        return BroadcastSync(rank=rank, master_address=master_address,
                             **self._sender_kwargs(on_gpu, device))


class P2PWeightPath(WeightPath):
    def describe_plan(self, num_learners: int, receivers: Sequence["WeightReceiver"]) -> str:
        from transfer.weights.p2p import format_plan, plan_p2p  # torch: see WeightPath

        return format_plan(plan_p2p(num_learners, receivers), receivers)

    def build(self, *, rank: int, world_size: int, master_address: str, on_gpu: bool,
              device: str) -> "WeightSync":
        from transfer.weights.p2p import P2PSync  # torch: see WeightPath

        return P2PSync(rank=rank, world_size=world_size, master_address=master_address,
                       **self._sender_kwargs(on_gpu, device))


DATA_PATHS: dict[type[TransferConfig], type[DataPath]] = {
    RayTransferConfig: RayDataPath,
    MooncakeTransferConfig: MooncakeDataPath,
}
"""Schema of a ``transfer`` choice (``rl.config.transfer.SCHEMAS``) -> what builds it."""

WEIGHT_PATHS: dict[type[WeightsConfig], type[WeightPath]] = {
    BroadcastWeightsConfig: BroadcastWeightPath,
    P2PWeightsConfig: P2PWeightPath,
}
"""Schema of a ``weights`` choice (``rl.config.weights.SCHEMAS``) -> what builds it."""


def data_path(cfg: TransferConfig) -> DataPath:
    """The rollout-data backend that ``cfg`` chooses."""
    return _lookup(DATA_PATHS, "DATA_PATHS", cfg)(cfg)


def weight_path(cfg: WeightsConfig) -> WeightPath:
    """The weight path that ``cfg`` chooses."""
    return _lookup(WEIGHT_PATHS, "WEIGHT_PATHS", cfg)(cfg)


def _lookup(registry: dict, name: str, cfg: object):
    """The entry of ``cfg``'s schema, or of the nearest schema it extends."""
    for schema in type(cfg).__mro__:
        if schema in registry:
            return registry[schema]
    raise ValueError(f"{type(cfg).__name__} has no backend: add it to rl.backends.{name}")
