"""``fasttorch.state.commit``: a donated state's tensors take the new values, in place,
wherever a new tensor fits one of them, eagerly and inside a graph."""

from __future__ import annotations

import pytest
import torch
from tolerance import EXACT

from fasttorch.state import commit


def _old_new():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    old = {
        "fits": r(2, 3),
        "same": r(3),
        "shape": r(2),
        "dtype": r(4),
        "none": None,
        "inner": {"fits": r(5), "count": torch.tensor(3)},
    }
    new = {
        "fits": r(2, 3),
        "same": old["same"],  # an update that already happened in place
        "shape": r(3),  # another shape: kept as it is
        "dtype": r(4, dtype=torch.float64),  # another dtype: kept as it is
        "none": r(2),  # nothing to write into
        "added": r(1),  # a new key
        "inner": {"fits": r(5), "count": torch.tensor(4)},
    }
    return old, new


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_each_fitting_tensor_is_written_into_the_old_one(mode):
    old, new = _old_new()
    before = dict(old)
    inner = dict(old["inner"])
    expected = {
        "fits": new["fits"].clone(),
        "inner.fits": new["inner"]["fits"].clone(),
        "inner.count": new["inner"]["count"].clone(),
    }

    def run(old, new):
        return commit(True, old, new)

    fn = run if mode == "eager" else torch.compile(run, backend="aot_eager", fullgraph=True)
    out = fn(old, new)
    assert out.keys() == new.keys()
    assert out["fits"] is before["fits"] and out["same"] is before["same"]
    assert out["inner"]["fits"] is inner["fits"] and out["inner"]["count"] is inner["count"]
    torch.testing.assert_close(out["fits"], expected["fits"], **EXACT)  # copies: rule 1
    torch.testing.assert_close(out["inner"]["fits"], expected["inner.fits"], **EXACT)
    torch.testing.assert_close(out["inner"]["count"], expected["inner.count"], **EXACT)
    for key in ("shape", "dtype", "none", "added"):  # nothing of the old one fits
        assert out[key] is new[key], key


def test_without_donation_the_new_state_is_returned_as_it_is():
    old, new = _old_new()
    assert commit(False, old, new) is new
