"""A weight receiver in a spawned process of its own, with nothing else in it: it joins the
sender's side group (``transfer.weights.group.init_side_group``, as the CPU engine does) and
receives buckets; it can be told to die in the middle of one. ``PeerReceiver`` is its
``WeightReceiver`` on the test's side, talking to it over a pipe."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.multiprocessing as mp


class _Peer:
    """The receiving side, inside the spawned process."""

    def __init__(self, die_after: int | None) -> None:
        self.die_after = die_after
        self.received = 0
        self.groups: dict[str, Any] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.version = ""
        self.session = False

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        from transfer.weights.group import init_side_group

        self.groups[group_name] = init_side_group(
            backend=backend, master_address=master_address, master_port=master_port,
            rank=rank_offset, world_size=world_size, group_name=group_name, timeout_s=60)

    def begin_weight_update(self) -> None:
        self.session = True

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str) -> None:
        for name, dtype, shape in zip(names, dtypes, shapes):
            buf = torch.empty(shape, dtype=getattr(torch, dtype))
            self.groups[group_name].broadcast(buf, src=0)
            self.received += 1
            if self.die_after is not None and self.received >= self.die_after:
                os._exit(1)  # dies in the middle of the bucket, its broadcasts unfinished
            self.weights[name] = buf
        self.version = weight_version

    def end_weight_update(self) -> None:
        self.session = False

    def get_weight_version(self) -> str:
        return self.version

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.groups.pop(group_name).destroy()

    def weight(self, name: str) -> list[float]:
        return self.weights[name].tolist()


def _serve(conn, die_after: int | None) -> None:
    peer = _Peer(die_after)
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the test process is gone
            return
        try:
            conn.send(("ok", getattr(peer, method)(*args)))
        except Exception as e:  # noqa: BLE001 - the answer an engine would give, as it stands
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PeerReceiver:
    """``WeightReceiver`` backed by a spawned ``_Peer``; one call at a time, as an engine's
    HTTP API answers one update call at a time. ``die_after``: the process exits once it has
    received that many tensors in all."""

    num_ranks = 1

    def __init__(self, name: str, die_after: int | None = None) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, die_after), daemon=True)
        self.process.start()
        self._lock = threading.Lock()

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((method, args))
                status, value = self._conn.recv()
            except (EOFError, OSError) as e:
                raise ConnectionError(f"{self.name}: its process exited "
                                      f"(exit code {self.process.exitcode})") from e
        if status == "error":
            raise ValueError(value)
        return value

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        self._call("init_weights_update_group", master_address, master_port, rank_offset,
                   world_size, group_name, backend)

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str) -> None:
        self._call("update_weights_from_distributed", names, dtypes, shapes, group_name,
                   weight_version)

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def get_weight_version(self) -> str:
        return self._call("get_weight_version")

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("destroy_weights_update_group", group_name)

    def weight(self, name: str) -> list[float]:
        return self._call("weight", name)

    def stop(self) -> None:
        """Kill the process (an engine replaced is stopped for good, stuck or not)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
