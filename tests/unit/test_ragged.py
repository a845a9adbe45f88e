"""``Ragged``, the flat ragged column: what it gives equals what one array per sample gives."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from transfer.data.base import Ragged


def _arrays(seed=0, n=9):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, rng.integers(0, 6)).astype(np.int32) for _ in range(n)]


def test_indexing_iteration_and_lengths_match_the_arrays():
    arrays = _arrays()
    r = Ragged.from_arrays(arrays)
    assert len(r) == len(arrays) and r.lengths.tolist() == [len(a) for a in arrays]
    for i, a in enumerate(arrays):
        assert r[i].tolist() == a.tolist() and r[i - len(arrays)].tolist() == a.tolist()
        assert np.shares_memory(r[i], r.values) or len(a) == 0  # a view
    assert [x.tolist() for x in r] == [a.tolist() for a in arrays]
    with pytest.raises(IndexError):
        r[len(arrays)]


def test_take_gathers_in_any_order_with_repeats():
    arrays = _arrays(1)
    idx = [8, 0, 3, 3, 5, -1, -9]
    got = Ragged.from_arrays(arrays).take(idx)
    assert [x.tolist() for x in got] == [arrays[i].tolist() for i in idx]
    assert got.offsets[0] == 0 and got.offsets[-1] == len(got.values)
    assert len(Ragged.from_arrays(arrays).take([])) == 0


def test_padding_positions_sums_and_zeroing():
    arrays = _arrays(2)
    r = Ragged.from_arrays(arrays)
    start = np.arange(len(arrays)) % 3
    out = np.full((len(arrays), 12), -1, dtype=np.int64)
    out[r.rows_and_columns(start)] = r.values
    for i, a in enumerate(arrays):
        row = out[i]
        assert row[start[i]:start[i] + len(a)].tolist() == a.tolist()
        assert (np.delete(row, np.arange(start[i], start[i] + len(a))) == -1).all()
    assert r.sums().tolist() == [float(a.sum()) for a in arrays]
    z = r.with_zeroed(np.array([1, 4]))
    assert all((z[i] == 0).all() == (i in (1, 4) or not arrays[i].any()) for i in range(len(arrays)))
    assert r[1].tolist() == arrays[1].tolist()  # the original is untouched


def test_bad_offsets_are_refused_and_pickle_keeps_both_arrays():
    with pytest.raises(ValueError, match="rise from 0"):
        Ragged(np.zeros(3), np.array([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="rise from 0"):
        Ragged(np.zeros(3), np.array([0, 2]))
    r = Ragged.from_arrays(_arrays(3))
    back = pickle.loads(pickle.dumps(r, protocol=5))
    assert np.array_equal(back.values, r.values) and np.array_equal(back.offsets, r.offsets)
