"""``weights=broadcast``: learner rank 0 gathers each bucket and broadcasts it to every engine.

One side group holds the sender (rank 0) and every engine rank. Per push, rank 0 opens a
weight-update session on every engine; per bucket, it asks each engine (over its HTTP API,
in parallel threads) to receive the named tensors, then broadcasts them in the same order;
then it closes the sessions (the engines flush their cache once, here) and checks that every
engine serves the new version. All learner ranks take part in gathering the sharded
parameters; only rank 0 sends.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterable, Sequence

import torch

from transfer.weights.base import WeightReceiver, dtype_name, full_tensor, iter_buckets
from transfer.net import free_port
from transfer.weights.group import SideGroup, init_side_group

logger = logging.getLogger(__name__)

class EngineRefused(RuntimeError):
    """An engine refused a bucket (e.g. an update outside a weight-update session)."""


class UpdateFailed(RuntimeError):
    """A weight-update call failed on some engines. ``unanswered``: the URLs of those that
    gave no answer at all within the bound (dead, or stuck in a broadcast a dead peer left
    unfinished): rollout fault tolerance replaces those."""

    def __init__(self, message: str, unanswered: list[str]) -> None:
        super().__init__(message)
        self.unanswered = unanswered

    def __reduce__(self):  # keeps ``unanswered`` across Ray's pickling of task errors
        return type(self), (str(self), self.unanswered)


STUCK_S = 5.0
"""After a broadcast failed (a peer left), how long the engines get to answer their update
call: one still waiting then is stuck in the unfinished broadcast (a gloo or NCCL receive
ends only at the group's timeout) and counts as unanswered."""


def _url(receiver: WeightReceiver) -> str:
    return getattr(receiver, "url", receiver.name)


class BroadcastSync:
    group_name = "rl-weights-broadcast"

    def __init__(self, *, rank: int, master_address: str, bucket_bytes: int, backend: str,
                 timeout_s: float, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.receivers: list[WeightReceiver] = []
        self.group: SideGroup | None = None
        self.broken = False
        """A broadcast of the group failed: it is formed again before the next push."""
        self._pool: ThreadPoolExecutor | None = None

    # -- setup -------------------------------------------------------------------------
    def connect(self, receivers: Sequence[WeightReceiver]) -> None:
        if not receivers:
            raise ValueError("weights=broadcast needs at least one engine to send to")
        if self.rank == 0:
            self._open_group(receivers)

    def reconnect(self, receivers: Sequence[WeightReceiver], replaced: Sequence[int]) -> None:
        """Every engine is in the one group: rank 0 forms it again with all of them."""
        if self.rank == 0 and (replaced or self.broken):
            self._reopen_group(receivers, gone=replaced)

    def _reopen_group(self, receivers: Sequence[WeightReceiver], gone: Sequence[int]) -> None:
        """Leave the current group (the engines still in it, all but the positions
        ``gone``, destroy their side, so that they can join a group of the same name) and
        host a new one with ``receivers``."""
        self._leave_group(skip=gone)
        self._open_group(receivers)

    def _open_group(self, receivers: Sequence[WeightReceiver]) -> None:
        """Host a side group with ``receivers`` (this process is rank 0 in it)."""
        self.receivers = list(receivers)
        self.broken = False
        self._pool = ThreadPoolExecutor(max_workers=len(receivers), thread_name_prefix="wsync")
        port = free_port()
        world_size = 1 + sum(r.num_ranks for r in receivers)
        offsets = [1 + sum(r.num_ranks for r in receivers[:i]) for i in range(len(receivers))]
        futures = {
            self._pool.submit(r.init_weights_update_group, self.master_address, port, off,
                              world_size, self.group_name, self.backend): r
            for r, off in zip(receivers, offsets)
        }
        try:
            # NCCL's watchdog ends an operation that exceeds the group's timeout (group.py):
            # give it a margin, so that the sender's own bound (weights.timeout_s) fires first,
            # names the engines and aborts the group.
            margin = 60.0 if self.backend == "nccl" else 0.0
            self.group = init_side_group(backend=self.backend, master_address=self.master_address,
                                         master_port=port, rank=0, world_size=world_size,
                                         group_name=self.group_name, timeout_s=self.timeout_s + margin)
        except Exception as e:  # the engines' answers say why the rendezvous failed
            self._raise_engine_errors(futures, cause=e)
            raise
        self._raise_engine_errors(futures)

    # -- per step ----------------------------------------------------------------------
    def push(self, named_params: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """One weight-update session per push: ``begin``, every bucket, ``end`` (which also
        flushes the engines' prefix cache), then every engine must report ``version``."""
        t0 = time.perf_counter()
        sent = 0
        gathered = ((name, full_tensor(p)) for name, p in named_params)  # collective
        failure: Exception | None = None
        try:
            if self.receivers:  # ranks without engines only take part in the gather
                try:
                    self._on_engines("begin_weight_update")
                except Exception as e:
                    failure = e
            for bucket in iter_buckets(gathered, self.bucket_bytes):
                if not self.receivers or failure is not None:
                    # After a failure this rank keeps gathering without sending: the other
                    # learner ranks wait in the same FSDP all-gathers and would otherwise hang
                    # there until the process-group timeout (30 min), holding the run open.
                    continue
                try:
                    sent += self._send_bucket(bucket, version)
                except Exception as e:
                    failure = e
            if failure is not None:
                raise failure
        except BaseException:
            if self.receivers:
                self._end_sessions_after_failure()
            raise
        if self.receivers:
            self._on_engines("end_weight_update")
            check_versions(self.receivers, version, self._pool, self.timeout_s)
        # A sender delivers one copy per receiving engine rank (gloo/nccl broadcast moves
        # about that much); `weights/bytes` is the model size each engine receives.
        return {"weights/bytes": float(sent),
                "weights/sender_bytes": float(sent * sum(r.num_ranks for r in self.receivers)),
                "weights/push_s": time.perf_counter() - t0}

    def _end_sessions_after_failure(self, wait_s: float = 5.0) -> None:
        """Best effort, bounded: close the engines' sessions so that a later push can open
        new ones (SGLang refuses a second ``begin`` while one is open). An engine stuck in
        the failed broadcast does not answer; it is named, and the original error raised."""
        assert self._pool is not None
        futures = {self._pool.submit(r.end_weight_update): r for r in self.receivers}
        done, pending = wait(futures, timeout=wait_s)
        for f in done:
            if f.exception() is not None:
                logger.warning("%s: closing the session after a failed push: %s", futures[f].name,
                               f.exception())
        for f in pending:
            logger.warning("%s: no answer to end_weight_update within %.0fs after a failed push",
                           futures[f].name, wait_s)

    def _on_engines(self, method: str) -> None:
        assert self._pool is not None, "connect() first"
        self._raise_engine_errors({self._pool.submit(getattr(r, method)): r for r in self.receivers})

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> int:
        """Ask every engine to receive the bucket, then broadcast its tensors in order (each
        one a broadcast, as SGLang receives them)."""
        assert self.group is not None and self._pool is not None, "connect() first"
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        futures = {
            self._pool.submit(r.update_weights_from_distributed, names, dtypes, shapes,
                              self.group_name, str(version)): r
            for r in self.receivers
        }
        tensors = [t.to(self.device).contiguous() for _, t in bucket]
        try:
            self._broadcast(tensors, futures)
        except Exception as e:  # refused by an engine, or a peer left the group
            # The other engines may wait in this broadcast until the group's timeout (gloo and
            # NCCL alike): those that do not answer soon count as unanswered and are replaced.
            # This side aborts at once: NCCL's queued broadcasts would otherwise run into the
            # watchdog's timeout (SideGroup.abort; a no-op for gloo). The group is not
            # destroyed here: destroying a gloo group waits for its queued broadcasts, which
            # left the learners' own gloo all-gathers hanging at the next push (measured); it
            # goes when the group is formed again, after the stuck engines were stopped.
            self.broken = True
            self.group.abort()
            self._raise_engine_errors(futures, cause=e, timeout_s=min(self.timeout_s, STUCK_S))
            raise
        self._raise_engine_errors(futures)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _broadcast(self, tensors: list[torch.Tensor], futures: dict) -> None:
        """Broadcast the bucket's tensors, but fail at once when an engine refuses the bucket:
        it will never join, and waiting would only end at the group's timeout. The
        broadcasts are issued from a helper thread because NCCL sets up its communicator at
        the first one and blocks there until every rank has joined."""
        issued: dict = {}

        def issue() -> None:
            try:
                issued["works"] = [self.group.broadcast(t, src=0, async_op=True) for t in tensors]
            except BaseException as e:  # raised again on the caller's thread below
                issued["error"] = e

        threading.Thread(target=issue, name="wsync-broadcast", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while "error" not in issued and not ("works" in issued and
                                             all(w.is_completed() for w in issued["works"])):
            refused = [f for f in futures if f.done() and f.exception() is not None]
            if refused:
                raise EngineRefused("weight update failed on " + "; ".join(
                    f"{futures[f].name}: {f.exception()}" for f in refused))
            if time.monotonic() > deadline:
                raise TimeoutError(f"broadcast of a weight bucket not done within {self.timeout_s:.0f}s "
                                   "(weights.timeout_s)")
            time.sleep(0.0005)
        if "error" in issued:
            raise issued["error"]
        for w in issued["works"]:
            w.wait()

    def _raise_engine_errors(self, futures: dict, cause: BaseException | None = None,
                             timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        done, pending = wait(futures, timeout=timeout_s)
        errors = [f"{futures[f].name}: {f.exception()}" for f in done if f.exception()]
        errors += [f"{futures[f].name}: no answer within {timeout_s:.0f}s" for f in pending]
        if errors:
            raise UpdateFailed("weight update failed on " + "; ".join(errors),
                               [_url(futures[f]) for f in pending]) from cause

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        self._leave_group(skip=())

    def _leave_group(self, skip: Sequence[int]) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
            for r in (r for i, r in enumerate(self.receivers) if i not in skip):
                try:
                    r.destroy_weights_update_group(self.group_name)
                except Exception as e:  # an engine already gone has nothing left to destroy
                    logger.warning("%s: destroy_weights_update_group failed: %s", r.name, e)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def check_versions(receivers: Sequence[WeightReceiver], version: int,
                   pool: ThreadPoolExecutor | None, timeout_s: float) -> None:
    """Every engine must now report ``version``; a stale engine is an error, never skipped."""
    if not receivers:
        return
    assert pool is not None
    futures = {pool.submit(r.get_weight_version): r for r in receivers}
    done, pending = wait(futures, timeout=timeout_s)
    problems = [f"{futures[f].name}: no answer within {timeout_s:.0f}s" for f in pending]
    for f in done:
        if f.exception() is not None:
            problems.append(f"{futures[f].name}: {f.exception()}")
        elif str(f.result()) != str(version):
            problems.append(f"{futures[f].name}: reports version {f.result()!r}, expected {version!r}")
    if problems:
        raise RuntimeError("engines do not serve the pushed weights: " + "; ".join(problems))
