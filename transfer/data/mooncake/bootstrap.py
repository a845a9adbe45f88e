"""Everything a Mooncake run settles on the driver before any worker starts, and the
settings each client is then built with.

* ``start_services``: import the wheel (a wrong one is reported now, not in a worker),
  resolve the protocol and device with their ``MOONCAKE_*`` fallbacks, refuse an RDMA
  device this machine lacks and a loopback hostname on several nodes, check that the
  segments hold what the run keeps in the store at once, and find or start the master (a
  local one on 127.0.0.1 when no address is given on a single machine). ``preflight`` is
  the part that starts nothing (it needs no Ray).
* ``check_node_env``: what another node exported (``NODE_ENV``), read there by the driver.
* ``client_settings``: one client's ``MooncakeSettings`` from what ``start_services``
  resolved and this process's own environment (read on each node).

A ``MOONCAKE_*`` variable fills in only a setting that the config leaves unset: a value the
user chose (``transfer=mooncake_tcp`` sets ``protocol: tcp``) is never overridden.

Plain values in, plain values out: no config object, no ``Runtime`` (``transfer`` imports
nothing from ``rl``). Error messages name the settings as a user of the trainer sets them
(``transfer.<field>``, ``transfer=mooncake_tcp``), since that is where the fix goes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Callable, Optional

from transfer.data.mooncake.client import (PROTOCOLS, MooncakeSettings, import_mooncake,
                                           require_master)
from transfer.data.mooncake.master import MooncakeMaster
from transfer.units import human_size

logger = logging.getLogger(__name__)
NODE_ENV = ("MOONCAKE_LOCAL_HOSTNAME",)
"""Variables a client reads on its own node (exported there before ``ray start``); with
several nodes the driver reads each node's values and hands them to ``check_node_env``."""


def resolve_protocol(protocol: Optional[str]) -> str:
    """``protocol`` when the config sets it; else env MOONCAKE_PROTOCOL; else tcp. The
    variable fills in only an unset field: ``transfer=mooncake_tcp`` (``protocol: tcp``)
    stays TCP on a node that exports ``MOONCAKE_PROTOCOL=rdma``."""
    proto, source = (protocol, "transfer.protocol") if protocol else \
        (os.environ.get("MOONCAKE_PROTOCOL") or "tcp", "MOONCAKE_PROTOCOL")
    if proto not in PROTOCOLS:
        raise ValueError(f"{source}={proto!r}: use {' or '.join(PROTOCOLS)}")
    return proto


def describe_protocol(protocol: Optional[str], device_name: Optional[str]) -> str:
    """What this run uses and where it came from, for the driver's start-up line."""
    proto, env = resolve_protocol(protocol), os.environ.get("MOONCAKE_PROTOCOL")
    if not protocol:
        where = " (MOONCAKE_PROTOCOL)" if env else " (the default)"
    else:
        where = f" (MOONCAKE_PROTOCOL={env} ignored: the config sets it)" if env and env != protocol else ""
    device = resolve_device(device_name)
    return f"protocol {proto}{where}" + (f", device {device}" if device else "")


def resolve_device(device_name: Optional[str]) -> str:
    """``device_name``, else env MOONCAKE_DEVICE, else none."""
    return device_name or os.environ.get("MOONCAKE_DEVICE") or ""


def resolve_hostname(local_hostname: Optional[str], default: str) -> str:
    """``local_hostname``, else env MOONCAKE_LOCAL_HOSTNAME, else ``default`` (the node IP)."""
    return local_hostname or os.environ.get("MOONCAKE_LOCAL_HOSTNAME") or default


def start_services(*, log_dir: str, num_nodes: int, partition_bytes: int, batches_held: int,
                   master_server_address: Optional[str], metadata_server: Optional[str],
                   local_hostname: Optional[str], protocol: Optional[str],
                   device_name: Optional[str], global_segment_size: int, replica_num: int,
                   master_start_timeout_s: float
                   ) -> tuple[dict[str, str], Optional[Callable[[], None]]]:
    """Check the environment and capacity, then find or start the master. Returns the
    resolved addresses (``master_server_address``, ``metadata_server``, and for a local
    master ``admin_url`` and ``master_pid``) and a stop function (None for an external one)."""
    preflight(num_nodes=num_nodes, partition_bytes=partition_bytes, batches_held=batches_held,
              master_server_address=master_server_address, local_hostname=local_hostname,
              protocol=protocol, device_name=device_name, global_segment_size=global_segment_size,
              replica_num=replica_num)
    logger.info("%s", describe_protocol(protocol, device_name))
    master = master_server_address or os.environ.get("MOONCAKE_MASTER")
    if master:
        metadata = (metadata_server or os.environ.get("MOONCAKE_METADATA_SERVER")
                    or f"http://{master.rpartition(':')[0]}:8080/metadata")
        return {"master_server_address": master, "metadata_server": metadata}, None
    if num_nodes > 1:
        raise ValueError(
            f"transfer=mooncake_*: no master address and the Ray cluster has {num_nodes} "
            "nodes. Start a master on one node: python -m transfer.data.mooncake.master "
            "--host <that node's IP>, then export MOONCAKE_MASTER=<ip>:50051 and "
            "MOONCAKE_METADATA_SERVER=http://<ip>:8080/metadata on every node before `ray start`")
    m = MooncakeMaster("127.0.0.1", log_path=os.path.join(log_dir, "mooncake_master.log"))
    m.start(timeout_s=master_start_timeout_s)
    logger.info("started a local master (pid %d) at %s; log %s", m.proc.pid, m.address, m.log_path)
    return {"master_server_address": m.address, "metadata_server": m.metadata_server,
            "admin_url": m.admin_url, "master_pid": str(m.proc.pid)}, m.stop


def preflight(*, num_nodes: int, partition_bytes: int, batches_held: int,
              master_server_address: Optional[str], local_hostname: Optional[str],
              protocol: Optional[str], device_name: Optional[str], global_segment_size: int,
              replica_num: int) -> None:
    """Every check that starts nothing: the wheel imports, the environment, the capacity, and
    an external master (the field or MOONCAKE_MASTER) answers."""
    import_mooncake()  # a missing or wrong wheel is reported here, before workers start
    check_environment(num_nodes=num_nodes, local_hostname=local_hostname, protocol=protocol,
                      device_name=device_name)
    check_capacity(global_segment_size=global_segment_size, partition_bytes=partition_bytes,
                   batches_held=batches_held, replica_num=replica_num)
    master = master_server_address or os.environ.get("MOONCAKE_MASTER")
    if master:
        require_master(master)


def check_environment(*, num_nodes: int, local_hostname: Optional[str], protocol: Optional[str],
                      device_name: Optional[str]) -> None:
    """RDMA needs a device (and, on this machine, an RDMA card); other nodes cannot reach a
    loopback hostname."""
    device = resolve_device(device_name)
    if resolve_protocol(protocol) == "rdma":
        if not device:
            raise ValueError("transfer protocol rdma needs a device: set transfer.device_name "
                             "(e.g. mlx5_0) or export MOONCAKE_DEVICE on every node before "
                             "`ray start`; or use transfer=mooncake_tcp")
        if num_nodes == 1 and not _rdma_devices():
            raise ValueError(f"transfer protocol rdma: this machine has no RDMA device "
                             f"(/sys/class/infiniband is empty), {device!r} cannot work; "
                             "use transfer=mooncake_tcp")
    check_announced_hostname(local_hostname or os.environ.get("MOONCAKE_LOCAL_HOSTNAME"),
                             num_nodes=num_nodes, where="transfer.local_hostname")


def check_announced_hostname(host: Optional[str], *, num_nodes: int, where: str) -> None:
    """The address a client announces must reach it from the other nodes. ``where`` names
    the setting the value came from (the field, or a node's exported variable)."""
    if num_nodes > 1 and host and _is_loopback(host):
        raise ValueError(f"{where} is {host!r}, a loopback address, but the Ray cluster has "
                         f"{num_nodes} nodes: other nodes cannot reach it; unset it (the Ray node "
                         "IP is used) or give that node's routable address")


def check_node_env(node: str, env: Mapping[str, str], *, local_hostname: Optional[str],
                   num_nodes: int) -> None:
    """Refuse what ``node`` exported before ``ray start`` (``env``: its values of
    ``NODE_ENV``) if its clients could not work with it; a set field wins over every node's
    environment."""
    if local_hostname is None:
        check_announced_hostname(env.get("MOONCAKE_LOCAL_HOSTNAME"), num_nodes=num_nodes,
                                 where=f"MOONCAKE_LOCAL_HOSTNAME on node {node}")


def check_capacity(*, global_segment_size: int, partition_bytes: int, batches_held: int,
                   replica_num: int) -> None:
    """Each learner rank's segment must hold its partition of every batch kept at once, and
    with replicas the other ranks' copies as well (a full store fails a put mid-run, after
    minutes of work). ``partition_bytes``: an upper bound of one rank's partition of a step."""
    need = partition_bytes * batches_held * replica_num
    if global_segment_size < need:
        held = "one step's partition" if batches_held == 1 else \
            f"the partitions of {batches_held} rollout batches held at once (generation runs ahead)"
        raise ValueError(f"transfer.global_segment_size={global_segment_size} bytes is too "
                         f"small: each learner rank lends one segment, and {held} need about "
                         f"{need} bytes ({replica_num} replica(s)); set "
                         f"transfer.global_segment_size={human_size(need * 2)} or more")


def client_settings(services: Mapping[str, str], *, default_hostname: str,
                    local_hostname: Optional[str], protocol: Optional[str],
                    device_name: Optional[str], global_segment_size: int,
                    local_buffer_size: int, chunk_bytes: int, replica_num: int, codec: str,
                    init_kwargs: Mapping[str, Any]):
    """Settings of one client. ``services``: what ``start_services`` returned on the
    driver; ``default_hostname``: this node's address; ``global_segment_size``: what this
    client lends (0 = none)."""
    if "master_server_address" not in services:
        raise RuntimeError("the Mooncake master is not resolved: start_services() runs first")
    return MooncakeSettings(
        master_server_address=services["master_server_address"],
        metadata_server=services["metadata_server"],
        local_hostname=resolve_hostname(local_hostname, default_hostname),
        protocol=resolve_protocol(protocol), device_name=resolve_device(device_name),
        global_segment_size=global_segment_size, local_buffer_size=local_buffer_size,
        chunk_bytes=chunk_bytes, replica_num=replica_num, codec=codec,
        init_kwargs=dict(init_kwargs))


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
