"""A forward that several members of a several-model step share (``several(outputs=...)``).

The plain GAN loop runs the generator once per iteration: ``fake = G(z)``; the
discriminator's loss reads ``fake.detach()``, the generator's loss ``D(fake)``, and
``errG.backward()`` goes through ``D`` into ``fake`` and on through the graph of that
one forward into ``G``'s parameters. Here :func:`run_forwards` runs each shared forward
once at the start of a call, over its owner's parameters as leaves that require grad,
and keeps its autograd graph until the owner's step: every member reads the output as a
plain tensor (a graph input under ``compiled``, never a constant); the owner's gradient
phase (:func:`owner_grads`) also takes the gradient of its loss with respect to the
output, and the backward of the kept graph (:func:`backward_op`, an operator a compiled
graph calls as it is) carries it into the owner's parameters: the plain loop's single
``backward``, split at ``fake``, the same kernels in the same order.

``torch.library.custom_op`` is public API; the graph it backpropagates lives outside
the member's compiled graph (an autograd graph is a Python object, so the operator runs
it eagerly, under ``compiled`` too), handed over by the driver for one call: the call's
:class:`Pending` travels in the call's own scope (:mod:`fasttorch._core.state`), not in a
module-level table, so two calls running at once (threads, a step called inside another
call's loss) each backpropagate their own graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from fasttorch import struct
from fasttorch._core import state as _scope
from fasttorch._core.state import call_with
from fasttorch.phases import Batch, GradOut, Loss, Tensors
from fasttorch.state import TrainState
from fasttorch.steps import Step

__all__ = [
    "FORWARD_KEY",
    "PREFIX",
    "Forward",
    "Pending",
    "Request",
    "backward_op",
    "check_outputs",
    "check_owner_step",
    "owner_grads",
    "run_forwards",
]

PREFIX = "\x00output:"
"""Parameter-name prefix under which an owner's gradient phase differentiates its outputs."""


@attrs.frozen
class Forward:
    """A shared forward: ``fn(apply, batch)`` run with member ``owner``'s parameters."""

    owner: str
    fn: Callable[[Callable[..., Any], Batch], Any]


class Pending:
    """The graphs of one call's shared forwards, kept from the start of the call until
    their owner's step; a context manager that drops them when the call ends.

    ``graphs``: per owner, the shared forwards' outputs (with their graphs) and the
    leaves they were computed from. The driver runs the members' steps with this object
    in the call's scope (``_scope.scope(shared=pending)``), where :data:`backward_op`
    finds it.
    """

    def __init__(self) -> None:
        self.graphs: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def keep(self, key: str, outputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
        self.graphs[key] = (outputs, leaves)

    def __enter__(self) -> Pending:
        return self

    def __exit__(self, *exc: object) -> None:
        self.graphs.clear()


def _backward_impl(
    key: str, cotangents: list[torch.Tensor], params: list[torch.Tensor]
) -> list[torch.Tensor]:
    call = _scope.current().shared
    pending = call.graphs.get(key) if isinstance(call, Pending) else None
    if pending is None:
        raise RuntimeError(
            f"fasttorch: member {key!r}'s step reads a shared forward's output, but no "
            "forward of this call is pending: run the member's step through its several step"
        )
    outputs, leaves = pending
    found = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
    return [torch.zeros_like(p) if f is None else f for p, f in zip(params, found)]


backward_op = torch.library.custom_op(
    "fasttorch::shared_forward_backward", _backward_impl, mutates_args=()
)


@backward_op.register_fake  # type: ignore[untyped-decorator,misc]
def _backward_fake(
    key: str, cotangents: list[torch.Tensor], params: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [torch.empty_like(p) for p in params]


class Request(struct.Record):
    """The sub-state (:data:`FORWARD_KEY`) that turns an owner's loss phase into a shared
    forward for one call of it: the phase runs ``fn(apply, batch)`` under the owner's
    transforms of the loss phase (``with_amp``'s autocast) and keeps its output."""

    fn: Callable[[Callable[..., Any], Batch], Any] = struct.field(static=True)
    out: list[Any] = struct.field(static=True)

    def run(self, state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
        def apply(*args: Any, **kwargs: Any) -> Any:
            return call_with(state.module, (params, buffers), state.ties, args, kwargs)

        self.out.append(self.fn(apply, batch))
        zero = torch.zeros((), device=state.device)
        return Loss(zero, weight=zero)


FORWARD_KEY = "several.forward"
"""The sub-state under which a member's loss phase is asked to run a shared forward."""


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _copied(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def run_forwards(
    forwards: Mapping[str, Forward],
    steps: Mapping[str, Step],
    members: dict[str, Any],
    batch: Batch,
    copy_buffers: bool,
    pending: Pending,
    idle: tuple[str, ...] = (),
) -> Tensors:
    """Run each shared forward once; return the outputs (detached), by name.

    Each runs through its owner's loss phase as transformed (the same autocast as the
    owner's loss), over the owner's parameters as leaves that require grad. The owner's
    BatchNorm statistics are updated by it, as in the plain loop (on copies put back
    into ``members`` when the steps copy). Each owner's graphs are kept in ``pending``
    for its step; an ``idle`` owner (no step this call) runs its forward without
    gradient.
    """
    outputs: Tensors = {}
    kept: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for name, f in forwards.items():
        m: TrainState = members[f.owner]
        # Copies under compiled: a donating graph writes the state's tensors (and the
        # outputs it was given) back in place, which bumps the version counters that
        # the kept graph's saved tensors share with them; its backward would refuse.
        own = _detached if steps[f.owner].is_eager else _copied
        leaves = (
            kept[f.owner][1]
            if f.owner in kept
            else [own(p).requires_grad_() for p in m.params.values()]
        )
        if copy_buffers and m.buffers:
            members[f.owner] = m = m.replace(buffers={k: b.clone() for k, b in m.buffers.items()})
        request = Request(fn=f.fn, out=[])
        with torch.set_grad_enabled(f.owner not in idle):
            steps[f.owner].loss(
                m.with_substate(FORWARD_KEY, request), dict(zip(m.params, leaves)), m.buffers, batch
            )
        if not request.out:
            raise TypeError(
                f"several: output {name!r} is member {f.owner!r}'s forward, but its step was "
                "not built by fasttorch.model_step (whose loss phase runs it); build the "
                "member's step with model_step(loss_fn)"
            )
        out = request.out[0]
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            got = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(
                f"several: the shared forward {name!r} of member {f.owner!r} returned {got}; "
                "a shared forward returns one floating tensor (give several outputs "
                "several names)"
            )
        kept.setdefault(f.owner, ([], leaves))[0].append(out)
        outputs[name] = own(out)  # Tanh saves its output: a copy under compiled
    for owner, (outs, leaves) in kept.items():
        if owner not in idle:
            pending.keep(owner, outs, leaves)
    return outputs


def owner_grads(
    grad: Callable[[TrainState], GradOut],
    state: TrainState,
    owner: str,
    mine: tuple[str, ...],
    outputs: Tensors,
) -> GradOut:
    """The owner's gradient phase when it owns shared outputs ``mine``.

    ``grad(state)`` runs the gradient phase over ``state``, whose parameters here also
    hold each output under :data:`PREFIX`: the loss's gradient with respect to them comes
    from the same backward. The kept forwards' backward then carries it into the
    parameters (added to what the loss reached directly).
    """
    extra = {PREFIX + n: outputs[n] for n in mine}
    g = grad(state.replace(params={**state.params, **extra}))
    grads = dict(g.grads)
    cotangents = [grads.pop(PREFIX + n) for n in mine]
    unused = frozenset(k for k in g.unused if not k.startswith(PREFIX))
    if all(PREFIX + n in g.unused for n in mine):  # the loss never read them
        return g.replace(grads=grads, unused=unused)
    names = list(state.params)
    back = backward_op(owner, cotangents, [state.params[k] for k in names])
    for k, b in zip(names, back):
        grads[k] = b if k in unused else grads[k] + b
    return g.replace(grads=grads, unused=frozenset())


def check_outputs(
    steps: Mapping[str, Step], outputs: Mapping[str, Any] | None
) -> tuple[tuple[str, Forward], ...]:
    if outputs is None:
        return ()
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"several: outputs maps names to (member, forward_fn), got "
            f"{type(outputs).__name__}; write outputs={{'fake': ('g', make_fake)}}"
        )
    checked = []
    for name, spec in outputs.items():
        if not isinstance(name, str) or not (isinstance(spec, tuple) and len(spec) == 2):
            raise TypeError(
                f"several: outputs[{name!r}] is {spec!r}; give (member, forward_fn), e.g. "
                "outputs={'fake': ('g', lambda apply, batch: apply(batch[1]))}"
            )
        owner, fn = spec
        if owner not in steps:
            raise ValueError(
                f"several: output {name!r} is member {owner!r}'s forward, but the steps are "
                f"for {list(steps)}; a shared forward belongs to a member that trains here"
            )
        if not callable(fn):
            raise TypeError(
                f"several: output {name!r}: {fn!r} is not callable; give (member, forward_fn)"
                ", e.g. outputs={'fake': ('g', lambda apply, batch: apply(batch[1]))}"
            )
        checked.append((name, Forward(owner=owner, fn=fn)))
    return tuple(checked)


def check_owner_step(name: str, owner: str, step: Step) -> None:
    windowed = [t for t in step.transforms if t in ("grad_accumulate", "sync_on_last")]
    if windowed:
        raise ValueError(
            f"several: output {name!r} is member {owner!r}'s forward, whose step has "
            f"{windowed[0]}: its window backpropagates each microbatch on its own, past "
            "a forward shared for the call. Drop the output (the member's loss runs its "
            "forward itself) or the transform"
        )
