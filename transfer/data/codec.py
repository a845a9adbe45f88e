"""Columnar codec: a column dict <-> a JSON manifest plus one contiguous byte payload.

Encoding, per field (order kept):

* flat ragged (``Ragged``): its values and offsets buffers, each copied as they are (two
  copies for the whole column, whatever the number of samples);
* ragged (``list[np.ndarray]``, one dtype and trailing shape): the arrays concatenated
  along axis 0 into one values buffer, plus an int64 offsets buffer ``[n + 1]``;
* dense (``np.ndarray``): its bytes as they are, with dtype and shape;
* scalars (a list of ``int``/``float``/``bool``, no ``None``): one typed array;
* strings (a list of ``str``, no ``None``): their UTF-8 bytes concatenated, plus offsets;
* anything else JSON can hold (strings, ``None``, short metadata): inside the manifest.

Nothing is pickled: a payload read from a store cannot run code. ``plan`` computes the
manifest and the size without copying, ``write`` copies each field once into a caller's
buffer (a registered staging buffer), ``decode`` rebuilds the columns as zero-copy views
into the received buffer (a flat ragged column as one ``Ragged`` of two views; a per-sample
one as one view per sample). Buffers start at 64-byte boundaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from transfer.data.base import Columns, Ragged

FORMAT = 2
READS = (1, 2)
"""Manifest formats ``decode`` reads (2 added the flat ragged kind)."""
ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Plan:
    manifest: dict
    """JSON-able description of every field and where its bytes are."""
    nbytes: int
    """Payload size (aligned)."""
    writers: list[Callable[[np.ndarray], None]]
    """Each copies one buffer into the payload given as a uint8 array."""

    def manifest_bytes(self) -> bytes:
        return json.dumps(self.manifest, separators=(",", ":")).encode()


def plan(columns: Columns) -> Plan:
    fields: list[dict] = []
    writers: list[Callable[[np.ndarray], None]] = []
    cursor = 0

    def reserve(nbytes: int, fill: Callable[[np.ndarray], None]) -> list[int]:
        nonlocal cursor
        at = cursor
        cursor = align(cursor + nbytes)
        writers.append(lambda payload, at=at, n=nbytes: fill(payload[at:at + n]))
        return [at, nbytes]

    for name, value in columns.items():
        if not isinstance(name, str):
            raise TypeError(f"column names must be str, got {name!r}")
        kind = _kind(name, value)
        if kind == "dense":
            arr = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d shape
            fields.append({"name": name, "kind": "dense", "dtype": arr.dtype.str,
                           "shape": list(arr.shape),
                           "at": reserve(arr.nbytes, lambda dst, a=arr: _copy(dst, a))})
        elif kind == "flat_ragged":
            values, offsets = np.ascontiguousarray(value.values), value.offsets
            fields.append({
                "name": name, "kind": "flat_ragged", "dtype": values.dtype.str,
                "tail": list(values.shape[1:]), "count": len(value),
                "values": reserve(values.nbytes, lambda dst, a=values: _copy(dst, a)),
                "offsets": reserve(offsets.nbytes, lambda dst, o=offsets: _copy(dst, o))})
        elif kind == "ragged":
            arrays = value
            dtype, tail = arrays[0].dtype, arrays[0].shape[1:]
            for a in arrays:
                if a.dtype != dtype or a.shape[1:] != tail or a.ndim == 0:
                    raise TypeError(f"column {name!r}: ragged arrays must share one dtype and "
                                    f"trailing shape ({dtype}{tail} vs {a.dtype}{a.shape})")
            lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            row = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
            values_nbytes = int(offsets[-1]) * row
            fields.append({
                "name": name, "kind": "ragged", "dtype": dtype.str, "tail": list(tail),
                "count": len(arrays),
                "values": reserve(values_nbytes, lambda dst, arrs=arrays, dt=dtype, t=tail:
                                  _concat(dst, arrs, dt, t)),
                "offsets": reserve(offsets.nbytes, lambda dst, o=offsets: _copy(dst, o))})
        elif kind == "strings":
            blobs = [v.encode("utf-8") for v in value]
            offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
            np.cumsum([len(b) for b in blobs], out=offsets[1:])
            joined = np.frombuffer(b"".join(blobs), dtype=np.uint8)
            fields.append({"name": name, "kind": "strings", "count": len(blobs),
                           "values": reserve(joined.nbytes, lambda dst, a=joined: _copy(dst, a)),
                           "offsets": reserve(offsets.nbytes, lambda dst, o=offsets: _copy(dst, o))})
        elif kind == "scalars":
            pytype = "bool" if all(isinstance(x, (bool, np.bool_)) for x in value) else \
                "int" if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                             for x in value) else "float"
            arr = np.asarray(value, dtype={"bool": np.bool_, "int": np.int64, "float": np.float64}[pytype])
            fields.append({"name": name, "kind": "scalars", "pytype": pytype, "dtype": arr.dtype.str,
                           "count": len(arr), "at": reserve(arr.nbytes, lambda dst, a=arr: _copy(dst, a))})
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"column {name!r} of type {type(value).__name__} cannot be "
                                f"encoded (arrays, lists of arrays, scalars, or JSON): {e}") from None
            fields.append({"name": name, "kind": "json", "value": value})
    return Plan(manifest={"format": FORMAT, "nbytes": cursor, "fields": fields},
                nbytes=cursor, writers=writers)


def _kind(name: str, value: Any) -> str:
    if isinstance(value, Ragged):
        if value.values.dtype.hasobject:
            raise TypeError(f"column {name!r}: object arrays cannot be encoded")
        return "flat_ragged"
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"column {name!r}: object arrays cannot be encoded")
        return "dense"
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(x, np.ndarray) for x in value):
            if any(x.dtype.hasobject for x in value):
                raise TypeError(f"column {name!r}: object arrays cannot be encoded")
            return "ragged"
        if all(isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating)) for x in value):
            return "scalars"
        if all(isinstance(x, str) for x in value):
            return "strings"
        if any(isinstance(x, np.ndarray) for x in value):
            raise TypeError(f"column {name!r} mixes arrays and other values")
    return "json"


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    dst[:] = np.ascontiguousarray(src).reshape(-1).view(np.uint8)


def _concat(dst: np.ndarray, arrays: list[np.ndarray], dtype: np.dtype, tail: tuple) -> None:
    if not dst.nbytes:
        return
    out = dst.view(dtype).reshape((-1, *tail))
    np.concatenate(arrays, axis=0, out=out)


def write(p: Plan, payload: np.ndarray) -> None:
    """Copy every field into ``payload`` (uint8, at least ``p.nbytes`` long)."""
    assert payload.dtype == np.uint8 and payload.nbytes >= p.nbytes, (payload.dtype, payload.nbytes)
    for w in p.writers:
        w(payload)


def encode(columns: Columns) -> tuple[bytes, np.ndarray]:
    """(manifest, payload) in fresh memory; stores use ``plan``/``write`` into their own buffers."""
    p = plan(columns)
    payload = np.zeros(p.nbytes, dtype=np.uint8)
    write(p, payload)
    return p.manifest_bytes(), payload


def decode(manifest: bytes | dict, payload) -> Columns:
    """Rebuild the columns from ``payload`` (any buffer-protocol object) without copying:
    arrays are read-only-unsafe views that keep ``payload`` alive."""
    m = json.loads(manifest) if isinstance(manifest, (bytes, bytearray, memoryview, str)) else manifest
    if m.get("format") not in READS:
        raise ValueError(f"unknown manifest format {m.get('format')!r}")

    def view(at: list[int], dtype: str) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(payload, dtype=dt, count=at[1] // dt.itemsize, offset=at[0])

    out: Columns = {}
    for f in m["fields"]:
        kind = f["kind"]
        if kind == "dense":
            out[f["name"]] = view(f["at"], f["dtype"]).reshape(f["shape"])
        elif kind == "flat_ragged":  # rows from the offsets: a zero-width tail has no -1 to infer
            offsets = view(f["offsets"], "<i8")
            rows = int(offsets[-1])
            out[f["name"]] = Ragged(view(f["values"], f["dtype"]).reshape((rows, *f["tail"])), offsets)
        elif kind == "ragged":
            offsets = view(f["offsets"], "<i8").tolist()
            values = view(f["values"], f["dtype"]).reshape((offsets[-1], *f["tail"]))
            out[f["name"]] = [values[offsets[i]:offsets[i + 1]] for i in range(f["count"])]
        elif kind == "strings":
            raw_u8 = view(f["values"], "|u1")
            offsets = view(f["offsets"], "<i8").tolist()
            if not raw_u8.size or raw_u8.max() < 128:  # ASCII: byte offsets are str offsets
                text = raw_u8.tobytes().decode("ascii")
                out[f["name"]] = [text[offsets[i]:offsets[i + 1]] for i in range(f["count"])]
            else:
                raw = raw_u8.tobytes()
                out[f["name"]] = [raw[offsets[i]:offsets[i + 1]].decode("utf-8")
                                  for i in range(f["count"])]
        elif kind == "scalars":
            out[f["name"]] = view(f["at"], f["dtype"]).tolist()
        elif kind == "json":
            value = f["value"]
            out[f["name"]] = value
        else:
            raise ValueError(f"unknown field kind {kind!r} in manifest")
    return out
