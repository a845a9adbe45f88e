"""The rollout-data seam: a store that moves one column dict from a producer to consumers.

Call order, per step::

    ref = store.put(columns, key="run/step-3/rank-0", near=reader_location)  # producer
    columns = store.get(ref)                             # consumer (learner rank), any process
    store.remove([ref])                                  # anyone, once consumed; idempotent
    store.close()                                        # each process, at exit

Only the ``StoreRef`` (a few hundred bytes) travels through the control plane (Ray calls);
the payload goes through the store (the data plane). ``near`` is where the reader reads
fastest, its client's ``location`` (Mooncake: the reader's own segment, read with a local
copy); ``None``, or a store that cannot place data (Ray), puts where the store chooses.

A column dict maps a field name to one of:

* a ragged field: ``list[np.ndarray]``, one 1-D array per sample, all of one dtype;
* a dense field: ``np.ndarray`` (any shape; first axis is the sample axis by convention);
* a list of Python scalars (``int``/``float``/``bool``), strings, or ``None``.

``get`` returns the same names in the same order with the same dtypes and shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

Columns = dict[str, Any]


@dataclass(frozen=True)
class StoreRef:
    """A small, picklable handle to one stored column dict."""

    key: str
    """Store key (namespaced per run and step)."""
    backend: str
    """Name of the backend that wrote it (``ray``, ``mooncake``, ``mooncake-bundle``)."""
    nbytes: int
    """Payload size in bytes (array data; metadata excluded)."""
    handle: Any = None
    """Backend-specific payload locator (Ray: a one-element list holding the ObjectRef)."""
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Producer-side timings of this put (``put_ms``, ``encode_ms``); the consumer side's
    are the store's ``get_timings_ms``."""


class RemovedError(LookupError):
    """``get`` of a ref whose data was removed (or is otherwise gone from the store)."""


@runtime_checkable
class RolloutStore(Protocol):
    """Moves column dicts between processes. See the module docstring for the call order."""

    backend: str
    """Name written into every ``StoreRef`` (``ray``, ``mooncake``)."""
    location: str | None
    """Where data put ``near`` this client is read without the network (Mooncake: the name
    of the segment it lends), or None."""
    get_timings_ms: dict[str, float]
    """Consumer-side timings of this process's last ``get`` beyond its wall time (e.g.
    ``decode_ms``); empty when the backend has nothing to report apart from the get itself."""

    def put(self, columns: Columns, *, key: str, near: str | None = None) -> StoreRef:
        """Store ``columns`` under ``key``, placed at ``near`` (a reader's ``location``) when
        the store can place data; return a ref once the data is readable."""
        ...

    def get(self, ref: StoreRef) -> Columns:
        """Read the column dict behind ``ref`` (same names, dtypes, shapes, order); a ref
        whose data was removed raises ``RemovedError``."""
        ...

    def remove(self, refs: Sequence[StoreRef]) -> None:
        """Delete the data behind ``refs``; removing twice or removing a missing ref is a no-op."""
        ...

    def close(self) -> None:
        """Release this process's connection and buffers."""
        ...


def columns_nbytes(columns: Columns) -> int:
    """Bytes of array payload in a column dict (what a transfer has to move)."""
    total = 0
    for value in columns.values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            total += sum(a.nbytes for a in value)
    return total
