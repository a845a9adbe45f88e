"""Spawned processes that run one rank function after another, for the tests that need a
learner in a process of its own (a process group, FSDP2): each call costs the function's own
time, not a fresh interpreter that imports torch and transformers again (about 4 s a call)."""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _serve(conn) -> None:
    import torch.distributed as dist

    while (task := conn.recv()) is not None:
        fn, rank, args = task
        try:
            fn(rank, *args)
            conn.send(None)
        except BaseException:  # noqa: BLE001 - reported to the test as it stands
            conn.send(traceback.format_exc())
        finally:
            if dist.is_initialized():  # a failed call's group must not reach the next call
                dist.destroy_process_group()


class SpawnedRanks:
    """Up to ``size`` spawned processes; ``run(fn, args, nprocs)`` calls ``fn(rank, *args)`` in
    processes 0..nprocs-1 at once, as ``torch.multiprocessing.start_processes`` would, and
    raises with each failed rank's traceback. A failed or timed-out call ends every process
    (a rank may hang in a collective its peer left); the next call spawns new ones. The
    processes see ``os.environ`` as it was at the first call."""

    def __init__(self, size: int = 2, timeout_s: float = 300) -> None:
        self.size, self.timeout_s = size, timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        for _ in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(self, fn: Callable[..., None], args: tuple, nprocs: int = 1) -> None:
        assert 1 <= nprocs <= self.size, f"nprocs={nprocs}: this pool has {self.size} processes"
        if not self._procs or not all(p.is_alive() for p in self._procs):  # none yet, or one died
            self.close()
            self._start()
        for rank in range(nprocs):
            self._conns[rank].send((fn, rank, args))
        errors: dict[int, str] = {}
        pending, deadline = set(range(nprocs)), time.monotonic() + self.timeout_s
        while pending and not errors and time.monotonic() < deadline:
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0):
                    pending.discard(rank)
                    if (error := conn.recv()) is not None:
                        errors[rank] = error
                elif not proc.is_alive():
                    pending.discard(rank)
                    errors[rank] = f"exited with code {proc.exitcode}"
            time.sleep(0.02)
        why = "stopped: another rank failed" if errors else f"no answer within {self.timeout_s:.0f}s"
        errors.update({rank: why for rank in pending})  # waiting on a failed peer, or hung
        if errors:
            self.close()
            raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
