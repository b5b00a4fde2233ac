"""Reading DCP's files without running code from them, written once for every loader."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load

from fasttorch import _compat
from fasttorch.checkpoint._errors import CheckpointError, _as_checkpoint_error, _quiet

# torch 2.13 (and upstream, pytorch/pytorch#189308) reads DCP's ".metadata" with a
# plain pickle.load, and DefaultLoadPlanner.load_bytes unpickles any non-tensor entry with
# torch.load(weights_only=False). Tensors are read with weights_only=True. So fasttorch
# reads the metadata itself, with an unpickler that can only rebuild DCP's metadata
# records, and refuses every non-tensor entry.

_MetadataUnpickler = _compat.DcpMetadataUnpickler


def _unsafe(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(path)!r} refused: {what}. fasttorch never runs code from a "
        "checkpoint, and a pickle that names anything else could. If you wrote this "
        "checkpoint yourself and trust every byte of it, load it with "
        "trust_pickled=True"
    )


def _check_metadata(md: Any, path: Path, files: set[str]) -> None:
    """The metadata must be DCP's records pointing only into the manifest's files."""
    if not isinstance(md, _dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise _unsafe(path, ".metadata does not hold DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(
            entry, (_dcp_md.TensorStorageMetadata, _dcp_md.BytesStorageMetadata)
        ) or not isinstance(key, str):
            raise _unsafe(path, f".metadata entry {key!r} is a {type(entry).__name__}")
    if not isinstance(md.storage_data, dict):
        raise _unsafe(path, ".metadata has no storage table")
    for info in md.storage_data.values():
        name = getattr(info, "relative_path", None)
        if name not in files or getattr(info, "transform_descriptors", None):
            raise _unsafe(
                path, f".metadata points at {name!r}, which is not a plain file of the manifest"
            )


class _SafeReader(FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` for ``.metadata``."""

    def __init__(self, path: Path, files: set[str]) -> None:
        super().__init__(path)
        self._where = path
        self._files = files
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_md.Metadata:
        if self._metadata is None:
            try:
                with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                    md = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise _unsafe(self._where, f".metadata {e}") from e
            except Exception as e:
                raise CheckpointError(
                    f"checkpoint {str(self._where)!r}: unreadable DCP .metadata: {e!r}"
                ) from e
            _check_metadata(md, self._where, self._files)
            self._metadata = md
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = _dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md  # type: ignore[no-any-return]


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Loads tensors (read with ``weights_only=True``); refuses pickled entries."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
            "fasttorch does not unpickle checkpoint entries (trust_pickled=True does)"
        )


def _tensor_entries(reader: _SafeReader, keys: list[str], path: Path) -> dict[str, Any]:
    """The metadata of ``keys``: each must be a tensor entry (never a pickled one)."""
    md = reader.read_metadata()
    out = {}
    for key in keys:
        entry = md.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: its .metadata has no entry {key!r}, which "
                "its manifest lists"
            )
        if not isinstance(entry, _dcp_md.TensorStorageMetadata):
            raise _unsafe(path, f"its entry {key!r} is a pickled object, not a tensor")
        out[key] = entry
    return out


def _trust_warning(path: Path, *, stacklevel: int = 3) -> None:
    warnings.warn(
        f"checkpoint {str(path)!r} is read with trust_pickled=True: its pickled parts "
        "are unpickled without restriction and can run any code. Do this only for a "
        "checkpoint you wrote yourself",
        UserWarning,
        stacklevel=stacklevel,
    )


def _reader(
    path: Path, manifest: dict[str, Any], keys: list[str], *, trusted: bool, stacklevel: int
) -> tuple[FileSystemReader, dict[str, Any]]:
    """The reader of ``path``'s DCP files, and the metadata of ``keys``, each checked to
    be a tensor entry; with ``trusted`` (``trust_pickled=True``), DCP's own reader and
    no metadata, after a warning (``stacklevel`` counted from here, as ``warnings.warn``
    counts it)."""
    if trusted:
        _trust_warning(path, stacklevel=stacklevel + 1)
        return FileSystemReader(path), {}
    safe = _SafeReader(path, set(manifest["files"]))
    return safe, _tensor_entries(safe, keys, path)


def _read(
    path: Path,
    request: dict[str, Any],
    reader: FileSystemReader,
    *,
    trusted: bool,
    collective: bool,
) -> None:
    """Read the entries of ``request`` from ``path`` into it, in place, with DCP.

    ``reader`` is a :class:`_SafeReader` whose entries were checked with
    :func:`_tensor_entries`, or (``trusted``, for ``trust_pickled=True``) DCP's own.
    ``collective``: every rank of the job reads together (:func:`load`), rather than
    this process alone (:func:`model_state_dict`). Every failure is a CheckpointError.
    """
    with _as_checkpoint_error(f"loading {str(path)!r}", also=(ValueError,)), _quiet():
        _dcp_load(
            request,
            storage_reader=reader,
            planner=None if trusted else _TensorsOnlyPlanner(),
            no_dist=not collective,
        )
