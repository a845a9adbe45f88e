"""The packed codec round-trips every column kind exactly (property-based)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.support.batches import assert_same
from transfer.data import codec
from transfer.data.base import Ragged

DTYPES = st.sampled_from([np.int8, np.int32, np.int64, np.float16, np.float32, np.float64,
                          np.uint8, np.bool_])


@st.composite
def ragged(draw):
    dtype = draw(DTYPES)
    tail = draw(st.sampled_from([(), (2,), (3, 2), (0,)]))
    n = draw(st.integers(1, 6))
    return [draw(hnp.arrays(dtype, (draw(st.integers(0, 5)), *tail))) for _ in range(n)]


@st.composite
def flat_ragged(draw):
    arrays = draw(ragged())
    lengths = [len(a) for a in arrays]
    if draw(st.booleans()):  # no samples at all, the tail kept
        return Ragged(arrays[0][:0], np.zeros(1, dtype=np.int64))
    return Ragged.from_lengths(np.concatenate(arrays), lengths)


dense = DTYPES.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0,
                                                                   max_side=4)))
scalars = st.one_of(st.lists(st.integers(-2**62, 2**62), min_size=1, max_size=5),
                    st.lists(st.floats(allow_nan=False), min_size=1, max_size=5),
                    st.lists(st.booleans(), min_size=1, max_size=5))
jsonish = st.one_of(st.none(), st.lists(st.one_of(st.text(), st.none()), max_size=4),
                    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), st.just([]))
columns = st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(ragged(), flat_ragged(), dense,
                                                                   scalars, jsonish),
                          max_size=6)


@settings(max_examples=200, deadline=None)
@given(columns)
def test_round_trip(cols):
    manifest, payload = codec.encode(cols)
    json.loads(manifest)  # plain JSON, nothing pickled
    assert_same(cols, codec.decode(manifest, payload))


def test_views_are_zero_copy_and_aligned():
    cols = {"a": [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)],
            "b": np.ones((4, 2), dtype=np.float32),
            "c": Ragged.from_lengths(np.arange(7, dtype=np.float32), [4, 0, 3])}
    manifest, payload = codec.encode(cols)
    out = codec.decode(manifest, payload)
    assert isinstance(out["c"], Ragged) and out["c"][2].tolist() == [4.0, 5.0, 6.0]
    for arr in (out["a"][0], out["a"][1], out["b"], out["c"].values, out["c"].offsets):
        assert np.shares_memory(arr, payload)
    for f in json.loads(manifest)["fields"]:
        for k in ("at", "values", "offsets"):
            if k in f:
                assert f[k][0] % codec.ALIGN == 0


@pytest.mark.parametrize("bad,fragment", [
    ({"x": np.array([object()])}, "object arrays"),
    ({"x": [np.zeros(2, np.int32), np.zeros(2, np.int64)]}, "share one dtype"),
    ({"x": [np.zeros(2), "s"]}, "mixes arrays"),
    ({"x": {1, 2}}, "cannot be encoded"),
])
def test_bad_columns_are_named(bad, fragment):
    with pytest.raises(TypeError, match=fragment):
        codec.plan(bad)


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("turn_credit", [False, True])
def test_the_capacity_estimate_bounds_the_packed_batch(n, turn_credit):
    """``RolloutBatch.estimate_nbytes`` (the stores' capacity check) holds a partition at its
    longest, every string column included, and overshoots it by little."""
    from rl.types import RolloutBatch
    from tests.support.batches import make_batch

    plen, rlen, label = 5, 9, "ü" * 6  # 12 bytes of UTF-8
    b = make_batch(n, response=(rlen, rlen))
    cols = {**b.__dict__, "prompt_len": np.full(n, plen, np.int32),
            "tokens": [np.ones(plen + rlen, np.int32)] * n,
            "finish_reason": ["length"] * n, "label": [label] * n,
            "token_advantages": [np.zeros(rlen, np.float32)] * n if turn_credit else None}
    packed = codec.plan(RolloutBatch(**cols).to_columns()).nbytes
    bound = RolloutBatch.estimate_nbytes(n, plen, rlen, label_bytes=12, token_advantages=turn_credit)
    assert packed <= bound < packed + 20 * 64 + 64, (packed, bound)
