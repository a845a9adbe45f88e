"""An SGLang engine's weight-update side without its server: one process per tensor-parallel
rank, each with its own default gloo world (SGLang's TP group) and SGLang's own
``init_weights_update_group`` / ``receive_weights_from_distributed`` (``tests.support.sglang_release``).

``SGLangRanks`` satisfies ``transfer.weights.WeightReceiver``, so the project's real senders
(``BroadcastSync``, ``P2PSync``) drive it exactly as they drive an engine over HTTP. The
session calls only record their order: the session rule itself is SGLang's scheduler, which
the CPU engine reproduces and ``test_engine*.py`` (tests/unit, tests/integration) check.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor


def _rank_main(tp_rank: int, tp_size: int, tp_port: int, conn) -> None:
    import datetime

    import torch.distributed as dist

    from tests.support.sglang_release import EngineWeightUpdater

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank,
                            world_size=tp_size, timeout=datetime.timedelta(seconds=60))
    updater = EngineWeightUpdater(tp_rank)
    received: list[tuple[str, object]] = []  # every tensor, in the order it arrived
    while True:
        cmd, kwargs = conn.recv()
        try:
            if cmd == "init":
                conn.send(updater.init_weights_update_group(**kwargs))
            elif cmd == "update":
                weights = updater.receive_weights_from_distributed(**kwargs)
                received.extend((n, t.clone()) for n, t in weights)
                conn.send((True, "ok"))
            elif cmd == "received":
                conn.send(received)
            elif cmd == "destroy":
                pg = updater._model_update_group.pop(kwargs["group_name"])
                dist.destroy_process_group(pg)
                conn.send((True, "ok"))
            elif cmd == "exit":
                conn.send((True, "bye"))
                return
        except Exception as e:  # reported to the sender's side, like SGLang's answers
            conn.send((False, f"{type(e).__name__}: {e}"))


class SGLangRanks:
    """One engine of ``num_ranks`` tensor-parallel ranks (processes)."""

    def __init__(self, name: str, num_ranks: int = 1) -> None:
        from transfer.net import free_port

        self.name = name
        self.num_ranks = num_ranks
        self.calls: list[str] = []
        self.version: str | None = None
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        for r in range(num_ranks):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, num_ranks, port, child), daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        self._pool = ThreadPoolExecutor(num_ranks)

    def _all(self, cmd: str, **kwargs) -> list:
        def one(conn):
            conn.send((cmd, kwargs))
            if not conn.poll(120):
                raise TimeoutError(f"{self.name}: no answer to {cmd}")
            return conn.recv()
        answers = list(self._pool.map(one, self._conns))
        for a in answers:
            if isinstance(a, tuple) and a and a[0] is False:
                raise RuntimeError(f"{self.name}: {cmd} failed: {a[1]}")
        return answers

    # -- WeightReceiver --------------------------------------------------------------------
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend) -> None:
        self.calls.append("init")
        self._all("init", master_address=master_address, master_port=master_port,
                  rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                  backend=backend)

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version) -> None:
        self.calls.append("update")
        self._all("update", names=names, dtypes=dtypes, shapes=shapes, group_name=group_name)
        self.version = weight_version

    def end_weight_update(self) -> None:
        self.calls.append("end")

    def get_weight_version(self) -> str:
        return str(self.version)

    def destroy_weights_update_group(self, group_name) -> None:
        self.calls.append("destroy")
        self._all("destroy", group_name=group_name)

    # -- for the test ------------------------------------------------------------------------
    def received(self) -> list[list]:
        """Per rank: (name, tensor) in arrival order."""
        return self._all("received")

    def close(self) -> None:
        for conn, p in zip(self._conns, self._procs):
            if p.is_alive():
                try:
                    conn.send(("exit", {}))
                    conn.poll(10) and conn.recv()
                except (BrokenPipeError, EOFError):
                    pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        self._pool.shutdown(wait=False)
