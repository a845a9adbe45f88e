"""Side process groups for weight updates, outside the learners' own FSDP world.

The sender (a learner rank, always rank 0) and the engines' ranks meet in one small group
per update path. SGLang builds its side of that group in ``init_weights_update_group``
with ``init_custom_process_group`` (``sglang/srt/utils/common.py``): a ``tcp://`` rendezvous
through torch's ``rendezvous``, a ``PrefixStore(group_name)`` over the rendezvous store, then
torch's ``_new_process_group_helper``, which adds key prefixes of its own. The sender must
build its side the same way or the two never meet: a raw ``TCPStore`` + ``ProcessGroupGloo``
waits for keys SGLang never writes (measured: ``DistStoreError: wait timeout ... keys:
/rl-weights-broadcast/0/1``), and with NCCL the first broadcast hangs.
``tests/integration/test_sglang_contract.py`` joins this function with SGLang's own as the receiver.

Neither side needs a default process group: a learner that runs FSDP over its own world
and a CPU engine that runs none join the same side group alike.

A peer can die in the middle of a broadcast (an engine is replaced then, and the group formed
again): ``SideGroup.abort`` ends what is left of it, and an NCCL side group is built so that
such a failure never takes the process down (``ASYNC_ERROR_HANDLING``).
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # module attributes: tests patch them

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
"""ProcessGroupNCCL's ``ErrorHandlingMode::CleanUpOnly``: on a failed or timed-out collective
the watchdog aborts the group's communicators and the error reaches the caller's ``wait()``;
the default (3, ``SkipCleanUp``) rethrows in the watchdog thread, which ends the process."""


@dataclass
class SideGroup:
    pg: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    name: str
    aborted: bool = False
    """``abort`` was called: the group serves no further collective; destroy it, form a new one."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """``torch.distributed.broadcast`` in this group (SGLang's receivers call exactly
        this); returns the work handle when ``async_op``."""
        return dist.broadcast(tensor, src=src, group=self.pg, async_op=async_op)

    def abort(self) -> None:
        """End the group's pending collectives now, after a peer left in the middle of one.

        NCCL: ``ProcessGroupNCCL::abort`` calls ``ncclCommAbort`` on the group's communicators,
        which stops their queued kernels; otherwise the watchdog would end them only at the
        group's timeout, and ``destroy`` would wait for them first (its ``shutdown`` calls
        ``ncclCommFinalize`` and waits; on an aborted communicator it skips that). gloo has no
        abort (``Backend::abort`` is a no-op): its pending work ends when the peers' sockets
        close or at the group's timeout, and ``destroy`` must wait until then, because
        ``~ProcessGroupGloo`` joins its worker threads. The group stays registered until
        ``destroy``, so a new one of the same name can be formed only after that."""
        if self.pg is None or self.aborted:
            return
        self.aborted = True
        try:
            self.pg.abort()
        except RuntimeError as e:  # NCCL: the abort itself exceeded the group's timeout
            logger.warning("aborting weight-update group %r failed: %s; it is destroyed and "
                           "formed again at the next sync", self.name, e)

    def destroy(self) -> None:
        if self.pg is None:
            return
        try:
            dist.destroy_process_group(self.pg)
        except (RuntimeError, ValueError):
            pass  # already torn down by a peer's exit; nothing left to release
        self.pg = None  # type: ignore[assignment]


def tcp_url(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 hosts bracketed, as SGLang's ``NetworkAddress.to_tcp``."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def init_side_group(*, backend: str, master_address: str, master_port: int, rank: int,
                    world_size: int, group_name: str, timeout_s: float) -> SideGroup:
    """Host (rank 0) or join (rank > 0) a side group; blocks until every rank has joined.

    Rank 0's rendezvous store listens on ``master_address:master_port`` and waits for all
    ``world_size`` ranks, so start the other ranks' joins (SGLang's
    ``/init_weights_update_group``) before calling this on rank 0.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-update backend {backend!r}; use one of {BACKENDS}")
    if not group_name:
        raise ValueError("a weight-update group needs a non-empty name")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(tcp_url(master_address, master_port), rank,
                                                   world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    with _errors_do_not_end_the_process(backend):
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                               group_name=group_name, backend_options=None,
                                               timeout=timeout, device_id=None)
    # Group ranks equal "global" ranks here, so torch.distributed.broadcast(src=0, group=pg)
    # means the sender on both sides, whatever default world a process has.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return SideGroup(pg=pg, rank=rank, world_size=world_size, backend=backend, name=group_name)


@contextmanager
def _errors_do_not_end_the_process(backend: str) -> Iterator[None]:
    """Build an NCCL side group with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: a peer's death is
    an engine's fault that the run survives (the engine is replaced), not the learner's.
    ProcessGroupNCCL reads the variable once, in its constructor (``asyncErrorHandling_``),
    which ``_new_process_group_helper`` runs; so the learners' own group, built earlier, keeps
    its setting, and the variable is restored at once."""
    if backend != "nccl":
        yield
        return
    before = os.environ.get(ASYNC_ERROR_HANDLING)
    os.environ[ASYNC_ERROR_HANDLING] = CLEAN_UP_ONLY
    try:
        yield
    finally:
        if before is None:
            del os.environ[ASYNC_ERROR_HANDLING]
        else:
            os.environ[ASYNC_ERROR_HANDLING] = before
