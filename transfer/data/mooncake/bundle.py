"""``transfer=mooncake_*`` with ``transfer.codec=bundle``: Mooncake's own
``MooncakeBundleTransfer`` (``mooncake.structured_object_store``, one key per field buffer),
kept as the reference that the packed codec is measured against.

It needs one row per sample in every column, and its module ships only in the CUDA 13
wheel and the non-CUDA wheel (see docker/README.md).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Sequence

import numpy as np

from transfer.data.base import Columns, Ragged, StoreRef, columns_nbytes
from transfer.data.mooncake.client import MooncakeClient, MooncakeSettings, StoreError, StoreRemovedError


class MooncakeBundleStore(MooncakeClient):
    backend = "mooncake-bundle"  # its refs mean nothing to the packed codec, and vice versa
    codec = "bundle"

    def __init__(self, settings: MooncakeSettings) -> None:
        super().__init__(settings)
        try:  # an optional module of the optional wheel: imported when a bundle client is built
            from mooncake.structured_object_store import MooncakeBundleTransfer, export_dataproto_ref
        except ImportError as e:
            self.close()
            raise ImportError(f"transfer.codec=bundle needs mooncake.structured_object_store, which "
                              f"this Mooncake wheel lacks ({e}); use transfer.codec=packed") from e
        self.bundle = MooncakeBundleTransfer(self.client, key_prefix="rl",
                                             default_chunk_bytes=settings.chunk_bytes)
        self._export_ref = export_dataproto_ref

    def put(self, columns: Columns, *, key: str, near: str | None = None) -> StoreRef:
        t0 = time.perf_counter()
        # The bundle API takes one row per sample: a flat ragged column goes as its samples
        # (views, no copy) and is made flat again on get.
        flat = {name: v.values.dtype.str for name, v in columns.items() if isinstance(v, Ragged)}
        rows = {name: v.to_list() if name in flat else v for name, v in columns.items()}
        try:
            # bundle partitions allow no '/'; our keys use it as the namespace separator
            ref = self.bundle.put(rows, type="dict", namespace="rl",
                                  partition=re.sub(r"[^A-Za-z0-9_.-]", "_", key),
                                  config=self.replicate_near(near))
        except ValueError as e:
            hint = (" (the bundle API needs one row per sample in every column; codec=packed "
                    "has no such limit)") if "batch size" in str(e) else ""
            raise StoreError(f"transfer.codec=bundle cannot store {key!r}: {e}{hint}") from e
        put_ms = (time.perf_counter() - t0) * 1e3
        return StoreRef(key=key, backend=self.backend, nbytes=columns_nbytes(columns),
                        handle={"bundle": self._export_ref(ref), "order": list(columns), "flat": flat},
                        timings_ms={"put_ms": put_ms, "encode_ms": 0.0})

    def get(self, ref: StoreRef) -> Columns:
        self._check_ref(ref)
        try:
            out = self.bundle.get(ref.handle["bundle"], type="dict")
        except (KeyError, FileNotFoundError, json.JSONDecodeError) as e:  # its metadata is gone
            raise StoreRemovedError(f"Mooncake store (master {self.settings.master_server_address}): "
                                    f"get of bundle {ref.key!r}: removed already, or the learner "
                                    f"holding its segment closed ({type(e).__name__}: {e})") from e
        # decoding happens inside bundle.get: no separate decode time to report
        flat = ref.handle["flat"]
        return {name: _flat(out[name], flat[name]) if name in flat else _plain(out[name])
                for name in ref.handle["order"]}

    def remove(self, refs: Sequence[StoreRef]) -> None:
        for ref in refs:
            self._check_ref(ref)
        for ref in refs:
            try:
                self.bundle.cleanup_dataproto(ref.handle["bundle"])
            except (KeyError, FileNotFoundError):
                pass  # removed already


def _flat(samples: list, dtype: str) -> Ragged:
    """A flat ragged column from the bundle's per-sample arrays (one copy, which also takes
    them out of its pooled receive buffer)."""
    return Ragged.from_arrays([np.asarray(a) for a in samples], np.dtype(dtype))


def _plain(value: Any) -> Any:
    """Bundle results as plain ndarrays and lists, copied: its arrays are views of a pooled
    receive buffer that the next ``get`` on this client overwrites (two partitions read one
    after the other came back as two copies of the second), and its pool-backed subclasses
    cannot be pickled."""
    if isinstance(value, np.ndarray):
        return np.array(value, copy=True).view(np.ndarray)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
