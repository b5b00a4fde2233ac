"""Frozen, pytree-registered records: the shape of every piece of fasttorch state.

A record is a stdlib frozen dataclass (``dataclasses.replace`` traces under
``torch.compile(fullgraph=True)``; attrs' frozen ``__init__`` does not) registered with
``torch.utils._pytree`` so that ``torch.compile``, ``torch.func`` and checkpointing see
its tensor leaves. Fields marked ``static`` are configuration, not leaves: they travel in
the pytree's context, are compared by the compiler's guards, and should not change from
step to step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.utils._pytree as pytree
from typing_extensions import Self, dataclass_transform

__all__ = ["Record", "data_fields", "field"]

_STATIC = "fasttorch_static"
_INLINE = "fasttorch_inline"


def field(*, static: bool = False, inline: bool = False, **kwargs: Any) -> Any:
    """A record field; ``static=True`` keeps it out of the pytree leaves.

    ``inline=True``, for a record's only data field, a dict: its entries are the
    record's own pytree children, under their own keys, so the record flattens (and a
    checkpoint names its entries) as the dict would, without the field's name. For a
    record that replaces a plain dict of tensors, whose checkpoints must still load.

    Example:
        >>> import torch
        >>> from fasttorch import struct
        >>> class Kept(struct.Record):
        ...     tensors: dict = struct.field(inline=True)
        >>> paths, _ = torch.utils._pytree.tree_flatten_with_path(Kept({"a": torch.zeros(1)}))
        >>> [torch.utils._pytree.keystr(p) for p, _ in paths]
        ["['a']"]
    """
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata[_STATIC] = static
    if inline:
        if static:
            raise ValueError("struct.field: a static field cannot be inline (it has no leaves)")
        metadata[_INLINE] = True
    return dataclasses.field(metadata=metadata, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(field, dataclasses.field))
class Record:
    """Base class: subclasses become frozen dataclasses registered as pytree nodes.

    Records compare and hash by identity (``a == b`` is ``a is b``): their tensors have
    no single truth value. ``fasttorch.testing.assert_states_close`` compares values.

    Example:
        >>> import torch
        >>> from fasttorch import struct
        >>> class Counter(struct.Record):
        ...     count: torch.Tensor
        ...     every: int = struct.field(static=True, default=1)
        >>> c = Counter(torch.tensor(0))
        >>> c.replace(count=c.count + 1).count
        tensor(1)
        >>> torch.utils._pytree.tree_leaves(c)
        [tensor(0)]
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # eq=False: compared and hashed by identity, as nn.Module and torch.optim are. A
        # field-by-field == would compare tensors (an error for more than one element)
        # and a hash would hash dicts; compare values with testing.assert_states_close.
        dataclasses.dataclass(frozen=True, eq=False)(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        data = tuple(f.name for f in fields if not f.metadata.get(_STATIC, False))
        static = tuple(f.name for f in fields if f.metadata.get(_STATIC, False))
        # Read by code that walks records inside a compiled step, where dataclasses.fields()
        # and a field's metadata (a mappingproxy) do not trace on every torch release.
        cls.__fasttorch_data_fields__ = data  # type: ignore[attr-defined]
        inline = [f.name for f in fields if f.metadata.get(_INLINE, False)]
        if inline and len(data) != 1:
            raise TypeError(
                f"{cls.__name__}: the inline field {inline[0]!r} must be the record's only "
                f"data field (it has {list(data)}): its entries' keys are the record's own"
            )

        def flatten(obj: Any) -> tuple[list[Any], Any]:
            statics = tuple(getattr(obj, n) for n in static)
            if inline:
                entries = getattr(obj, data[0])
                return list(entries.values()), (tuple(entries), statics)
            return [getattr(obj, n) for n in data], statics

        def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
            children, ctx = flatten(obj)
            if inline:
                keys: list[Any] = [pytree.MappingKey(k) for k in ctx[0]]
                return list(zip(keys, children)), ctx
            return [(pytree.GetAttrKey(n), c) for n, c in zip(data, children)], ctx

        def unflatten(children: Any, ctx: Any) -> Any:
            if inline:
                entries = dict(zip(ctx[0], children))
                return cls(**{data[0]: entries}, **dict(zip(static, ctx[1])))
            return cls(**dict(zip(data, children)), **dict(zip(static, ctx)))

        pytree.register_pytree_node(
            cls,
            flatten,
            unflatten,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            flatten_with_keys_fn=flatten_with_keys,
        )

    __fasttorch_data_fields__: tuple[str, ...] = ()

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (``dataclasses.replace``); traces under compile."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def data_fields(record: Record) -> tuple[str, ...]:
    """The names of ``record``'s pytree leaves (its fields not marked ``static``).

    Computed once per class, so code traced by ``torch.compile`` reads a tuple of
    strings instead of ``dataclasses.fields`` and their metadata (a ``mappingproxy``,
    which dynamo in torch 2.10 cannot trace).

    Example:
        >>> import torch
        >>> from fasttorch import struct
        >>> class Window(struct.Record):
        ...     total: torch.Tensor
        ...     micro: int = struct.field(static=True, default=0)
        >>> struct.data_fields(Window(torch.tensor(0.0)))
        ('total',)
    """
    return type(record).__fasttorch_data_fields__
