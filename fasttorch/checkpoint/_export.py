"""The model's weights out of a checkpoint, without a template:
:func:`model_state_dict` and :func:`export_safetensors`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

from fasttorch.checkpoint._directory import _fsync_dir
from fasttorch.checkpoint._errors import CheckpointError, refuse_models
from fasttorch.checkpoint._manifest import _dtype, verify
from fasttorch.checkpoint._paths import _is_link, _path_arg
from fasttorch.checkpoint._read import (
    _read,
    _reader,
)
from fasttorch.state import TrainState, check_alive, is_sharded


def model_state_dict(
    path: str | os.PathLike[str], *, trust_pickled: bool = False
) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a checkpoint, keyed like ``model.state_dict()``.

    No template is needed: use it to export trained weights to a plain model,
    ``model.load_state_dict(model_state_dict(path))``. Keys carry no ``_orig_mod.`` or
    ``module.`` prefix, so the model need not be wrapped as it was in training. Like
    :func:`load`, it never runs code from the checkpoint unless ``trust_pickled``.

    Example:
        >>> import tempfile, torch, fasttorch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
        >>> path = fasttorch.checkpoint.save(tempfile.mkdtemp(), state)
        >>> torch.nn.Linear(2, 1).load_state_dict(fasttorch.checkpoint.model_state_dict(path))
        <All keys matched successfully>
    """
    p = _path_arg(path, "checkpoint.model_state_dict")
    _refuse_models_path(p, "checkpoint.model_state_dict")
    manifest = verify(p)
    request: dict[str, Any] = {}
    left_out = set(manifest.get("non_persistent", ()))
    for key, info in manifest["entries"].items():
        group = key.partition("/")[0]
        if group in ("params", "buffers") and key not in left_out:
            request[key] = torch.empty(info["shape"], dtype=_dtype(info["dtype"]))
    reader, _ = _reader(p, manifest, list(request), trusted=trust_pickled, stacklevel=3)
    _read(p, request, reader, trusted=trust_pickled, collective=False)
    out = {k.partition("/")[2]: v for k, v in request.items()}
    for key, source in manifest.get("aliases", {}).items():  # tied weights, by each name
        if source in request:
            out[key] = request[source]
    return out


def _refuse_models_path(p: Path, api: str) -> None:
    """Raise if ``p`` is the path ``save`` returned for a ``Models`` state: no checkpoint
    itself, but one per trained member at ``<directory>/<member>/<name>``."""
    if p.exists():
        return
    members = sorted(
        m.name for m in p.parent.glob("*") if (m / p.name / "fasttorch.json").is_file()
    )
    if members:
        paths = ", ".join(repr(str(p.parent / m / p.name)) for m in members)
        raise CheckpointError(
            f"{api}: {str(p)!r} names a checkpoint of several models (saved from a "
            f"fasttorch.Models state): one checkpoint per member, at {paths}. Give one "
            "member's path, or load them all with checkpoint.load(path, models_template)"
        )


# --------------------------------------------------------------------------- safetensors
# The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte
# little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} with
# optional "__metadata__" (str -> str), then the raw little-endian bytes. It is written
# here (~40 lines) rather than through the `safetensors` package, so that exporting
# needs no extra dependency; the tests read the files back with `safetensors` itself.

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def export_safetensors(
    source: str | os.PathLike[str] | TrainState,
    file: str | os.PathLike[str],
    *,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a model's weights to one ``.safetensors`` file that loads without fasttorch.

    ``source`` is a checkpoint directory (its :func:`model_state_dict`) or a live
    ``TrainState`` (its ``state_dict()``): exactly the keys of ``model.state_dict()``.
    Read it back with ``safetensors.torch.load_file(file)`` and
    ``model.load_state_dict(...)``, or hand it to any tool that reads safetensors. The
    file is written beside its final name and renamed into place once complete (an
    existing file, or a link, of that name is replaced, never written through).

    The plain PyTorch equivalent:
    ``safetensors.torch.save_file(model.state_dict(), file, metadata={"format": "pt"})``.

    Args:
        source: a checkpoint directory or a state (not a sharded one: export its
            checkpoint, which holds the whole tensors).
        file: the file to write; its directory must exist.
        metadata: extra ``str -> str`` entries for the header (``"format": "pt"`` is
            always set, as Hugging Face libraries expect).

    Example:
        >>> import tempfile, os, torch, fasttorch
        >>> from safetensors.torch import load_file
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> out = fasttorch.checkpoint.export_safetensors(
        ...     state, os.path.join(tempfile.mkdtemp(), "model.safetensors"))
        >>> torch.nn.Linear(2, 1).load_state_dict(load_file(out))
        <All keys matched successfully>
    """
    api = "checkpoint.export_safetensors"
    refuse_models(source, api, "export one member: export_safetensors(state[name], file)")
    if isinstance(source, TrainState):
        check_alive(source, api)
        if any(getattr(v, "stacks_members", False) for v in source.substates.values()):
            n = source.step.shape[0]
            raise ValueError(
                f"{api}: the state is a population of {n} members (every tensor stacked "
                f"along a leading dimension of {n}), and a safetensors file holds one "
                "model's weights, shaped as model.state_dict(). Export one member: "
                "export_safetensors(fasttorch.member(population, i), file), for example "
                "the best, i = metrics['loss'].argmin()"
            )
        if is_sharded(source.module):
            raise ValueError(
                f"{api}: the state is sharded (FSDP2), so it holds only this rank's "
                "shards. Save a checkpoint and export that path: it holds whole tensors"
            )
        tensors = {k: v for k, v in source.state_dict().items() if isinstance(v, torch.Tensor)}
    else:
        tensors = model_state_dict(_path_arg(source, api))
    out = _file_arg(file, api)
    head: dict[str, Any] = {"__metadata__": {**(metadata or {}), "format": "pt"}}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in head["__metadata__"].items()):
        raise TypeError(f"{api}: metadata must map str to str, got {metadata!r}")
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{api}: {name!r} is a {t.dtype} tensor, which safetensors cannot hold")
        raw = t.reshape(-1).view(torch.uint8)
        head[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.numel()],
        }
        offset += raw.numel()
        blobs.append(raw)
    _write_safetensors(out, head, blobs)
    return out


def _file_arg(file: Any, api: str) -> Path:
    if not isinstance(file, (str, os.PathLike)) or not str(os.fspath(file)).strip():
        raise ValueError(f"{api}: file must name a file to write, got {file!r}")
    out = Path(os.fspath(file))  # type: ignore[arg-type]
    if out.is_dir() and not _is_link(out):
        raise CheckpointError(
            f"{api}: {str(out)!r} is a directory; name a file, e.g. model.safetensors"
        )
    if not out.parent.is_dir():
        raise CheckpointError(
            f"{api}: the directory of {str(out)!r} does not exist; create it first"
        )
    return out


def _write_safetensors(out: Path, head: dict[str, Any], blobs: list[torch.Tensor]) -> None:
    if sys.byteorder != "little":
        raise CheckpointError("export_safetensors writes little-endian data; this machine is not")
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:  # a new file of ours: never an existing one or a link
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for raw in blobs:
                f.write(raw.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(out.parent)
