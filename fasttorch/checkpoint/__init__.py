"""Checkpoints of a whole ``TrainState``: atomic, verified, resumable bit for bit.

A checkpoint is a directory written by :mod:`torch.distributed.checkpoint` (DCP) under
a temporary name, completed by a manifest (``fasttorch.json``: step, world size, the
static facts of the state, every entry's shape and dtype, and each file's size and
SHA-256), then renamed into place. A directory without a manifest is incomplete and
never loaded; :func:`latest` skips it. Works from one process and from every rank of a
``torch.distributed`` job (call it on all ranks; the files go to a shared filesystem).

Keys are clean paths into the state: ``params/inp.weight``,
``opt_state/slots/exp_avg/inp.weight``, ``substates/amp/scale`` (no ``_orig_mod.`` or
``module.``). Values that differ between ranks are stored per rank under
``rank{r}/...``: the RNG, an open accumulation window and the user's ``data``; DCP
would otherwise keep one rank's value for a shared key, silently. In a state sharded
with FSDP2 (``fully_shard``) the shards of a parameter, and of what the optimizer and
EMA keep for it, are given to DCP as ``DTensor``s: each rank writes its part of the
whole tensor under the one key, and a load reads the part its template holds, so a
checkpoint saved on N ranks loads on M, sharded or not. The manifest lists those keys
(``sharded``) and gives every entry's whole shape.

Loading never runs code from the checkpoint directory: the user's ``data`` is JSON,
DCP's pickled ``.metadata`` is read by an unpickler that admits only DCP's own
metadata classes, tensors are read with ``torch.load(weights_only=True)``, and a
pickled object anywhere else is refused. ``trust_pickled=True`` opts out, for a
trusted checkpoint of format 1 (whose ``data`` was pickled). Nothing outside the
directory the user names is ever deleted or written: symbolic links are never
followed, and a checkpoint whose manifest is malformed is reported and left alone.
See docs/checkpointing.md for the trust model and the crash-safety rules.
"""

# One concern per module (docs/design.md, "Layout"):
#   _errors: the errors raised, and how DCP's failures and warnings become them
#   _json: the user's data, kept as JSON
#   _keys: the state's clean keys, per-rank entries, shards and static fields
#   _group: the agreement of the ranks of a process group
#   _paths: the paths a user names, and symbolic-link safety
#   _manifest: fasttorch.json, its checks, and verify
#   _directory: the directory of checkpoints: latest, prune, the lock
#   _models: what the save and the load of a fasttorch.Models state share
#   _save and _async_save: save and async_save (save_models: a Models state)
#   _read: reading DCP files without running code from them
#   _load: load and resume (load_models, latest_models: a Models state)
#   _export: model_state_dict and export_safetensors
from fasttorch.checkpoint._async_save import SaveHandle, async_save
from fasttorch.checkpoint._directory import latest, prune
from fasttorch.checkpoint._errors import CheckpointError, CheckpointMismatchError
from fasttorch.checkpoint._export import export_safetensors, model_state_dict
from fasttorch.checkpoint._load import latest_models, load, load_models, resume
from fasttorch.checkpoint._manifest import verify
from fasttorch.checkpoint._save import save, save_models

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "SaveHandle",
    "async_save",
    "export_safetensors",
    "latest",
    "latest_models",
    "load",
    "load_models",
    "model_state_dict",
    "prune",
    "resume",
    "save",
    "save_models",
    "verify",
]

# Reachable here as before the split (``name as name`` re-exports them): the format
# constants, and the internals that tests read; ``os`` is the module whose ``rename``
# tests/ckpt_worker.py replaces. Tests replace ``_save._publish``,
# ``_manifest._sha256`` and ``_directory._no_dir_sync_warned`` where they are defined.
import os as os

from fasttorch.checkpoint._async_save import wait_pending as wait_pending
from fasttorch.checkpoint._json import _Box as _Box
from fasttorch.checkpoint._keys import PER_RANK as PER_RANK
from fasttorch.checkpoint._keys import _flatten as _flatten
from fasttorch.checkpoint._keys import _is_per_rank as _is_per_rank
from fasttorch.checkpoint._manifest import FORMAT as FORMAT
from fasttorch.checkpoint._manifest import MANIFEST as MANIFEST
from fasttorch.checkpoint._read import _MetadataUnpickler as _MetadataUnpickler
