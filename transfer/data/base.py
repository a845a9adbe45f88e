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

* a ragged field, flat: ``Ragged(values, offsets)``, every sample's rows in one array
  (what the rollout manager builds: no per-sample arrays, so a codec copies it in one go);
* a ragged field, per sample: ``list[np.ndarray]``, one array per sample, all of one dtype
  and trailing shape;
* a dense field: ``np.ndarray`` (any shape; first axis is the sample axis by convention);
* a list of Python scalars (``int``/``float``/``bool``), strings, or ``None``.

``get`` returns the same names in the same order with the same dtypes and shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

Columns = dict[str, Any]


class Ragged:
    """A ragged column held flat: sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    ``values`` holds every sample's rows back to back (``[total, *tail]``), ``offsets`` is
    int64 ``[n + 1]`` from 0 to ``total``. Indexing a sample gives a view; ``take`` gathers
    samples in one vectorized copy; ``rows_and_columns`` says where each value lands in a
    right-padded ``[n, width]`` array, which is how the learner builds its micro-batches.
    """

    __slots__ = ("values", "offsets")

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        values, offsets = np.asarray(values), np.asarray(offsets, dtype=np.int64)
        if values.ndim == 0 or offsets.ndim != 1 or len(offsets) == 0:
            raise ValueError(f"Ragged needs values of >= 1 dimension and offsets [n + 1], got "
                             f"{values.shape} and {offsets.shape}")
        if offsets[0] != 0 or offsets[-1] != len(values) or (np.diff(offsets) < 0).any():
            raise ValueError(f"Ragged offsets must rise from 0 to len(values)={len(values)}, got "
                             f"{offsets[:3].tolist()}..{offsets[-1:].tolist()}")
        self.values, self.offsets = values, offsets

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], dtype=None) -> "Ragged":
        """One array per sample -> flat (one copy). ``dtype`` is needed when there are none."""
        if not len(arrays):
            return cls(np.zeros(0, dtype=dtype or np.float32), np.zeros(1, dtype=np.int64))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        return cls(np.concatenate(arrays, axis=0) if dtype is None
                   else np.concatenate(arrays, axis=0).astype(dtype, copy=False), offsets)

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: Sequence[int]) -> "Ragged":
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        """Sample ``i`` as a view; a slice gives a ``Ragged`` of those samples (a copy)."""
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        i = range(len(self))[i]  # negative indices and bounds as a list has them
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self):
        o = self.offsets.tolist()
        return (self.values[o[i]:o[i + 1]] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"Ragged({len(self)} samples, {self.values.dtype}{list(self.values.shape)})"

    def __reduce__(self):  # pickles as its two arrays (two out-of-band buffers, protocol 5)
        return (Ragged, (self.values, self.offsets))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.offsets.nbytes

    def to_list(self) -> list[np.ndarray]:
        """One view per sample (for code that wants them; the flat form needs none)."""
        return list(self)

    def sample_index(self) -> np.ndarray:
        """For each value, the sample it belongs to (int64 ``[total]``)."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.lengths)

    def take(self, idx) -> "Ragged":
        """Samples ``idx`` (in that order) as a new flat column, copied in one gather."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        lengths = self.lengths[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = self.offsets[:-1][idx]  # negative indices count from the end, as for lengths
        src = np.arange(offsets[-1], dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
        return Ragged(self.values[src], offsets)

    def rows_and_columns(self, start: np.ndarray | int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Where each value goes in a right-padded ``[n, width]`` array whose sample ``i``
        starts at column ``start[i]`` (or ``start`` for all): ``out[rows, cols] = values``."""
        rows = self.sample_index()
        within = np.arange(len(self.values), dtype=np.int64) - self.offsets[rows]
        return rows, within + (np.asarray(start, dtype=np.int64)[rows] if np.ndim(start) else start)

    def sums(self) -> np.ndarray:
        """Per sample, the sum of its values (float64 ``[n]``; 1-D values)."""
        return np.bincount(self.sample_index(), weights=self.values, minlength=len(self))

    def with_zeroed(self, samples: np.ndarray) -> "Ragged":
        """A copy whose values of ``samples`` (indices or a boolean mask) are zero."""
        values = self.values.copy()
        keep = np.ones(len(self), dtype=bool)
        keep[samples] = False
        values[~np.repeat(keep, self.lengths)] = 0
        return Ragged(values, self.offsets)


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
        if isinstance(value, (np.ndarray, Ragged)):
            total += value.nbytes
        elif isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            total += sum(a.nbytes for a in value)
    return total
