"""The errors a checkpoint raises, and how DCP's failures and warnings become them."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

from torch.distributed.checkpoint.api import CheckpointException

from fasttorch.models import Models
from fasttorch.state import TrainState

# DCP warns on every single-process save and load; that is fasttorch's normal case.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's single-process warning (pytest resets the import-time filter)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # catch_warnings is not thread-safe; the import-time filter applies
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, unsafe, or could not be written or read."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the template state it is loaded into."""


def _dcp_error(e: BaseException, what: str) -> CheckpointError:
    return CheckpointError(f"{what} failed in torch.distributed.checkpoint: {e!r}")


@contextlib.contextmanager
def _as_checkpoint_error(what: str, *, also: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Report a failed write, read or collective as the documented CheckpointError: a
    dead peer surfaces from gloo as a RuntimeError, DCP's own errors as a BaseException.
    ``also``: further errors to report so (a read's ValueError from a damaged file)."""
    failures: tuple[type[Exception], ...] = (RuntimeError, OSError, EOFError, *also)
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as e:
        raise _dcp_error(e, what) from e
    except failures as e:
        raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e


def check_state_kind(state: object, api: str, role: str = "state") -> None:
    """Raise a TypeError unless ``state`` is a ``TrainState`` or a ``Models`` state."""
    if not isinstance(state, (TrainState, Models)):
        raise TypeError(
            f"{api} takes a fasttorch.TrainState or a fasttorch.Models state as its "
            f"{role}, got {type(state).__name__}; pass the state a step returns "
            "(state, metrics = step(state, batch)) or one built the same way"
        )


def refuse_models(state: object, api: str, fix: str) -> None:
    """Raise a TypeError naming ``fix`` if ``state`` is a :class:`Models` (``api`` takes
    one model's state)."""
    if isinstance(state, Models):
        raise TypeError(
            f"{api} takes one model's TrainState, got a fasttorch.Models state (members "
            f"{list(state.members)}); {fix}"
        )
