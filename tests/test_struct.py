"""Records: an inline field flattens as the dict it holds, and is refused where its keys
could clash with another field's."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from fasttorch import struct


class _Kept(struct.Record):
    tensors: dict[str, torch.Tensor] = struct.field(inline=True)
    tag: int = struct.field(static=True, default=0)


def test_an_inline_record_flattens_under_the_dict_s_keys_and_comes_back():
    kept = _Kept({"a.weight": torch.ones(2), "b": torch.zeros(())}, tag=3)
    as_dict = {"a.weight": kept.tensors["a.weight"], "b": kept.tensors["b"]}
    paths = [p for p, _ in pytree.tree_flatten_with_path(kept)[0]]
    assert paths == [p for p, _ in pytree.tree_flatten_with_path(as_dict)[0]]
    leaves, spec = pytree.tree_flatten(kept)
    back = pytree.tree_unflatten([t + 1 for t in leaves], spec)
    assert isinstance(back, _Kept) and back.tag == 3 and list(back.tensors) == ["a.weight", "b"]
    assert torch.equal(back.tensors["a.weight"], torch.full((2,), 2.0))
    assert struct.data_fields(back) == ("tensors",)


def test_an_inline_field_must_be_the_only_data_field_and_not_static():
    with pytest.raises(TypeError, match=r"inline field 'a' must be the record's only data"):

        class _Two(struct.Record):
            a: dict[str, torch.Tensor] = struct.field(inline=True)
            b: torch.Tensor = struct.field(default=None)

    with pytest.raises(ValueError, match="a static field cannot be inline"):
        struct.field(static=True, inline=True)
