"""``model.master_dtype`` is float32 or the compute dtype (the rule composed here; the
training itself: tests/integration/test_mixed_precision.py)."""

from __future__ import annotations

import pytest

from tests.support.env import compose


@pytest.mark.parametrize("overrides,fragment", [
    (("model.dtype=bfloat16", "model.master_dtype=float16"), "model.master_dtype=float16 with model.dtype"),
    (("model.dtype=float16",), "float16 training needs loss scaling"),
    (("model.dtype=float16", "model.master_dtype=float16"), "use model.dtype=bfloat16"),
])
def test_master_dtype_is_float32_or_the_compute_dtype(overrides, fragment):
    with pytest.raises(ValueError, match=None) as e:
        compose(*overrides)
    assert fragment in str(e.value)
    assert compose("model.dtype=bfloat16").model.mixed_precision
