"""Two GANs that run the generator once per iteration, ported and held to their loops.

pytorch/examples' DCGAN (``dcgan/main.py``) and Lightning's manual-optimization GAN
(the ``SimpleGAN`` of its "Manual optimization" guide) compute ``fake = G(z)`` once per
iteration: the discriminator's step reads ``fake.detach()``, the generator's step
backpropagates ``D(fake)`` through that same forward. ``several(outputs=...)`` is that
loop: each port runs G once per call (its BatchNorm counts one batch per iteration),
and is compared with its loop, written as the source writes it, at tiny sizes.

Adam is ``from_torch(torch.optim.Adam)`` and the loops use ``torch.optim.Adam`` with its
default flags (on a CPU the single-tensor, non-capturable form, which reads the step
count as a Python number), at DCGAN's own ``lr=0.0002``. In fp32 both ports equal
their loops bit for bit (rule 1), eagerly (torch's own kernel) and compiled
(``backend="aot_eager"``: from_torch traces torch's default form with its bias
corrections in float64 tensors, the numbers the loop computes as Python floats, and the
graph runs eager's kernels). The batch is a power of two, so an accumulation window's
mean is exact. In bf16 the rules of tests/README.md's rule 4 apply where the two sides
round differently (stated at each test).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from tolerance import EXACT, params_atol
from torch import nn

import fasttorch
from fasttorch import optim
from fasttorch.several import UnknownMemberError

counters = torch._dynamo.utils.counters
NZ, NGF, NDF, NC, BATCH = 4, 4, 4, 1, 8  # powers of two: an exact window mean
LR = 2e-4  # dcgan/main.py's default: from_torch keeps a Python float's value
BETA1 = 0.5
DTYPES = {"bf16": torch.bfloat16}


def weights_init(m: nn.Module) -> None:
    """dcgan/main.py's initialisation."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    """dcgan/main.py's ``Generator`` at 8x8: transposed convolutions, BatchNorm, Tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NC, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)  # type: ignore[no-any-return]


class Discriminator(nn.Module):
    """dcgan/main.py's ``Discriminator`` at 8x8: strided convolutions, BatchNorm, Sigmoid."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 2, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1, 1).squeeze(1)  # type: ignore[no-any-return]


def models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    g, d = Generator(), Discriminator()
    g.apply(weights_init)
    d.apply(weights_init)
    return g, d


def data(k: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real images, noise) per iteration: the loop draws its noise; here it comes in."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.rand(BATCH, NC, 8, 8, generator=gen) * 2 - 1,
            torch.randn(BATCH, NZ, 1, 1, generator=gen),
        )
        for _ in range(k)
    ]


def autocast(precision: str) -> Any:
    return torch.autocast("cpu", dtype=DTYPES.get(precision), enabled=precision != "fp32")


# --------------------------------------------------------------------------- the loops


def dcgan_loop(
    g: nn.Module,
    d: nn.Module,
    batches: Sequence[Any],
    *,
    precision: str = "fp32",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, nn.Module, list[tuple[float, float]]]:
    """dcgan/main.py's training loop on deep copies (autocast around the forwards)."""
    netG, netD = copy.deepcopy(g).to(dtype), copy.deepcopy(d).to(dtype)
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=LR, betas=(BETA1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=LR, betas=(BETA1, 0.999))
    real_label, fake_label = 1.0, 0.0
    log = []
    for real_cpu, noise in batches:
        real_cpu, noise = real_cpu.to(dtype), noise.to(dtype)
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        with autocast(precision):
            output = netD(real_cpu)
            errD_real = criterion(output.to(dtype), label)
        errD_real.backward()
        with autocast(precision):
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output.to(dtype), label)
        errD_fake.backward()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        with autocast(precision):
            output = netD(fake)
            errG = criterion(output.to(dtype), label)
        errG.backward()
        optimizerG.step()
        log.append((float(errD.detach()), float(errG.detach())))
    return netG, netD, log


def lightning_loop(
    g: nn.Module,
    d: nn.Module,
    batches: Sequence[Any],
    *,
    accumulate: int = 1,
    precision: str = "fp32",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, nn.Module, list[tuple[float, float]]]:
    """Lightning's ``SimpleGAN.training_step`` (manual optimization) as plain PyTorch:
    ``manual_backward(loss)`` is ``loss.backward()``, ``toggle_optimizer(opt)`` turns
    off ``requires_grad`` of every parameter the other optimizer owns. ``accumulate``:
    D steps on every ``accumulate``-th batch with the sum of those batches' gradients
    (``manual_backward`` per batch, no division; ``zero_grad`` after the step)."""
    G, D = copy.deepcopy(g).to(dtype), copy.deepcopy(d).to(dtype)
    criterion = nn.BCELoss()
    g_opt = torch.optim.Adam(G.parameters(), lr=LR, betas=(BETA1, 0.999))
    d_opt = torch.optim.Adam(D.parameters(), lr=LR, betas=(BETA1, 0.999))

    def toggle(opt: torch.optim.Optimizer, on: bool) -> None:
        mine = {id(p) for group in opt.param_groups for p in group["params"]}
        for p in [*G.parameters(), *D.parameters()]:
            if id(p) not in mine:
                p.requires_grad_(not on)

    log = []
    for batch_idx, (X, z) in enumerate(batches):
        X, z = X.to(dtype), z.to(dtype)
        batch_size = X.shape[0]
        real_label = torch.ones((batch_size,), dtype=dtype)
        fake_label = torch.zeros((batch_size,), dtype=dtype)
        with autocast(precision):  # Trainer(precision="bf16-mixed"): autocast, forwards
            g_X = G(z)
        # Optimize Discriminator
        toggle(d_opt, True)
        with autocast(precision):
            d_x = D(X)
            errD_real = criterion(d_x.to(dtype), real_label)
            d_z = D(g_X.detach())
            errD_fake = criterion(d_z.to(dtype), fake_label)
        errD = errD_real + errD_fake
        if accumulate == 1:
            d_opt.zero_grad()
        errD.backward()  # self.manual_backward(errD)
        if (batch_idx + 1) % accumulate == 0:
            d_opt.step()
            if accumulate > 1:
                d_opt.zero_grad()
        toggle(d_opt, False)
        # Optimize Generator
        toggle(g_opt, True)
        with autocast(precision):
            d_z = D(g_X)
            errG = criterion(d_z.to(dtype), real_label)
        g_opt.zero_grad()
        errG.backward()  # self.manual_backward(errG)
        g_opt.step()
        toggle(g_opt, False)
        log.append((float(errD.detach()), float(errG.detach())))
    return G, D, log


# --------------------------------------------------------------------------- fasttorch


def make_fake(apply: Callable[..., torch.Tensor], batch: Any) -> torch.Tensor:
    real, noise = batch
    return apply(noise)


def d_loss(apply: Callable[..., torch.Tensor], batch: Any, models: fasttorch.Peers) -> Any:
    real, _ = batch
    criterion = nn.BCELoss()
    fake = models.outputs["fake"]  # G ran once this call; a constant here
    label = torch.full((real.size(0),), 1.0, dtype=real.dtype)
    errD_real = criterion(apply(real).to(real.dtype), label)
    errD_fake = criterion(apply(fake.detach()).to(real.dtype), torch.zeros_like(label))
    return errD_real + errD_fake


def g_loss(apply: Callable[..., torch.Tensor], batch: Any, models: fasttorch.Peers) -> Any:
    real, _ = batch
    output = models["d"](models.outputs["fake"])  # backward: through D, then G's forward
    return nn.BCELoss()(output.to(real.dtype), torch.ones(real.size(0), dtype=real.dtype))


def adam_from_torch() -> optim.Optimizer:
    return optim.from_torch(torch.optim.Adam, lr=LR, betas=(BETA1, 0.999))


def adam_native() -> optim.Optimizer:
    return optim.adam(LR, betas=(BETA1, 0.999))


def gan(
    *,
    precision: str = "fp32",
    compile: bool = False,
    d_wrap: Callable[[fasttorch.Step], fasttorch.Step] = lambda s: s,
) -> fasttorch.Several:
    def member(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.model_step(loss_fn)
        return fasttorch.with_amp(s, precision) if precision != "fp32" else s

    step = fasttorch.several(
        {"d": d_wrap(member(d_loss)), "g": member(g_loss)},
        outputs={"fake": ("g", make_fake)},
    )
    return fasttorch.compiled(step, backend="aot_eager") if compile else step


def state(
    g: nn.Module, d: nn.Module, opt: Callable[[], optim.Optimizer] = adam_from_torch
) -> tuple[fasttorch.Models, list[int]]:
    """The state, and a list that counts the generator's forwards."""
    calls: list[int] = []
    gen = copy.deepcopy(g)
    gen.register_forward_pre_hook(lambda m, a: calls.append(1))
    models = fasttorch.Models.create(
        d=fasttorch.TrainState.create(copy.deepcopy(d), opt()),
        g=fasttorch.TrainState.create(gen, opt()),
    )
    return models, calls


def run(step: fasttorch.Several, s: fasttorch.Models, batches: Sequence[Any]) -> Any:
    log = []
    for b in batches:
        s, m = step(s, b)
        log.append((float(m["d"]["loss"]), float(m["g"]["loss"])))
    return s, log


def tensors(s: fasttorch.Models) -> dict[str, torch.Tensor]:
    out = {}
    for tag in ("g", "d"):
        m = s[tag]
        assert isinstance(m, fasttorch.TrainState)
        out.update({f"{tag}.{k}": v for k, v in {**m.params, **m.buffers}.items()})
    return out


def reference(g: nn.Module, d: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{f"g.{k}": v for k, v in g.state_dict().items()},
        **{f"d.{k}": v for k, v in d.state_dict().items()},
    }


def assert_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(ours) == sorted(ref)
    for k, v in ref.items():
        bound = {"rtol": 0.0, "atol": atol} if v.is_floating_point() else EXACT
        torch.testing.assert_close(ours[k], v, **bound, msg=lambda m, k=k: f"{k}: {m}")


def loop_error(
    loop: Callable[..., Any], g: nn.Module, d: nn.Module, batches: Any, **kw: Any
) -> Any:
    """Rule 2: the fp32 loop's error against the same loop in float64, per tensor, and
    its largest loss error."""
    g32, d32, log32 = loop(g, d, batches, **kw)
    g64, d64, log64 = loop(g, d, batches, dtype=torch.float64, **kw)
    r32, r64 = reference(g32, d32), reference(g64, d64)
    errors = {
        k: float((v.double() - r64[k]).abs().max()) for k, v in r32.items() if v.is_floating_point()
    }
    loss = float((torch.tensor(log32).double() - torch.tensor(log64)).abs().max())
    return errors, loss


# --------------------------------------------------------------------------- DCGAN


def test_dcgan_port_equals_its_loop_bit_for_bit_with_g_run_once() -> None:
    g, d = models()
    batches = data(4)
    ref_g, ref_d, ref_log = dcgan_loop(g, d, batches)
    s, g_calls = state(g, d)
    s, log = run(gan(), s, batches)
    assert len(g_calls) == len(batches)  # one generator forward per iteration
    assert_close(tensors(s), reference(ref_g, ref_d), 0.0)  # BatchNorm statistics too
    assert int(s["g"].buffers["main.1.num_batches_tracked"]) == len(batches)
    assert int(s["d"].buffers["main.3.num_batches_tracked"]) == 3 * len(batches)
    torch.testing.assert_close(torch.tensor(log), torch.tensor(ref_log), **EXACT)


@pytest.mark.parametrize("port", ["dcgan", "lightning"])
def test_compiled_port_equals_its_loop_bit_for_bit(port: str) -> None:
    """Rule 1: compiled (aot_eager runs eager's kernels, from_torch traces torch's
    default Adam form), each port is its plain loop with default ``torch.optim.Adam``
    bit for bit: parameters, BatchNorm statistics and counters, losses. G runs once per
    call, two graphs in all (one per member), no recompile as the step count grows (it
    is a tensor) and no graph break (no host read inside the step)."""
    g, d = models(0 if port == "dcgan" else 2)
    batches = data(4, seed=1 if port == "dcgan" else 3)
    loop = dcgan_loop if port == "dcgan" else lightning_loop
    ref_g, ref_d, ref_log = loop(g, d, batches)
    counters.clear()
    s, g_calls = state(g, d)
    fast, log = run(gan(compile=True), s, batches)
    assert counters["stats"]["unique_graphs"] == 2
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    assert len(g_calls) == len(batches)
    assert int(fast["g"].buffers["main.1.num_batches_tracked"]) == len(batches)
    assert_close(tensors(fast), reference(ref_g, ref_d), 0.0)
    torch.testing.assert_close(torch.tensor(log), torch.tensor(ref_log), **EXACT)


@pytest.mark.parametrize("port", ["dcgan", "lightning"])
def test_compiled_port_in_bf16_is_the_eager_port_within_rule_4(port: str) -> None:
    """The traced autocast rounds where eager's does not: one iteration, with
    fasttorch's Adam on both sides, rule 4 with ``half_roundings=2`` (as
    test_several.py's half-precision GAN under compiled, for the same reason: a flip's
    ``lr * u`` then moves the next iteration's BatchNorm batch statistics)."""
    precision = "bf16"
    g, d = models(0 if port == "dcgan" else 2)
    batches = data(1, seed=1 if port == "dcgan" else 3)
    eager, _ = run(gan(precision=precision), state(g, d, adam_native)[0], batches)
    counters.clear()
    s, g_calls = state(g, d, adam_native)
    fast, _ = run(gan(precision=precision, compile=True), s, batches)
    assert counters["stats"]["unique_graphs"] == 2
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    assert len(g_calls) == len(batches)
    loop = dcgan_loop if port == "dcgan" else lightning_loop
    errors, _ = loop_error(loop, g, d, batches)
    ours = tensors(fast)
    atol = params_atol(errors, ours, precision=precision, steps=1, lr=LR, half_roundings=2)
    assert_close(ours, tensors(eager), atol)


def test_dcgan_port_in_bf16_one_iteration() -> None:
    """DCGAN backpropagates errD_real and errD_fake one after the other, so D's weight
    gradient is the fp32 sum of two bf16 gradients; a member's one loss sums them in
    bf16 first (one rounding of each of D's weight gradients differs: rule 4 with
    ``half_roundings=2``, the two terms). Over more iterations Adam carries such a
    difference into G wherever a gradient is near zero (the README's caveat), so one
    iteration is compared; Lightning's port, with one backward, matches bf16 bit for bit."""
    g, d = models()
    batches = data(1)
    ref_g, ref_d, ref_log = dcgan_loop(g, d, batches, precision="bf16")
    s, g_calls = state(g, d)
    s, log = run(gan(precision="bf16"), s, batches)
    assert len(g_calls) == 1
    ours = tensors(s)
    errors, _ = loop_error(dcgan_loop, g, d, batches)
    atol = params_atol(errors, ours, precision="bf16", steps=1, lr=LR, half_roundings=2)
    assert_close(ours, reference(ref_g, ref_d), atol)


# --------------------------------------------------------------------------- Lightning


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lightning_manual_optimization_gan_port(precision: str) -> None:
    g, d = models(2)
    batches = data(4, seed=3)
    ref_g, ref_d, ref_log = lightning_loop(g, d, batches, precision=precision)
    s, g_calls = state(g, d)
    s, log = run(gan(precision=precision), s, batches)
    assert len(g_calls) == len(batches)
    # One backward per loss, as in the guide: the same bits in fp32 and in bf16.
    assert_close(tensors(s), reference(ref_g, ref_d), 0.0)
    torch.testing.assert_close(torch.tensor(log), torch.tensor(ref_log), **EXACT)


def test_lightning_summed_accumulation_is_scale_loss_of_grad_accumulate() -> None:
    # manual_backward per batch without dividing by the window: the window's sum, which
    # is grad_accumulate's mean times the window's length.
    g, d = models(2)
    batches = data(4, seed=3)
    ref_g, ref_d, _ = lightning_loop(g, d, batches, accumulate=2)
    s, _ = state(g, d)

    def summed(step: fasttorch.Step) -> fasttorch.Step:
        return fasttorch.scale_loss(fasttorch.grad_accumulate(step, 2, across_calls=True), 2)

    s, _ = run(gan(d_wrap=summed), s, batches)
    assert int(s["d"].step) == 2 and int(s["g"].step) == 4
    assert_close(tensors(s), reference(ref_g, ref_d), 0.0)


# --------------------------------------------------------------------------- errors


def test_shared_forward_errors_are_raised_at_wrap_time() -> None:
    d_step, g_step = fasttorch.model_step(d_loss), fasttorch.model_step(g_loss)
    with pytest.raises(ValueError, match=r"member 'x'.*steps are for \['d', 'g'\]"):
        fasttorch.several({"d": d_step, "g": g_step}, outputs={"fake": ("x", make_fake)})
    with pytest.raises(TypeError, match=r"give \(member, forward_fn\)"):
        fasttorch.several({"d": d_step, "g": g_step}, outputs={"fake": make_fake})  # type: ignore[dict-item]
    windowed = fasttorch.grad_accumulate(g_step, 2)
    with pytest.raises(ValueError, match=r"'g'.*grad_accumulate.*Drop the output"):
        fasttorch.several({"d": d_step, "g": windowed}, outputs={"fake": ("g", make_fake)})


def test_a_loss_asking_for_an_undeclared_output_is_told_what_exists() -> None:
    g, d = models()
    s, _ = state(g, d)
    step = fasttorch.several({"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_loss)})
    with pytest.raises(UnknownMemberError, match=r"outputs\['fake'\].*are \[\]"):
        step(s, data(1)[0])


def test_eval_step_of_the_generator_reads_the_shared_output_in_evaluation_mode() -> None:
    g, d = models()
    s, g_calls = state(g, d)
    batch = data(1)[0]
    metrics = gan().eval_step("g")(s, batch)
    ref_g, ref_d = copy.deepcopy(g).eval(), copy.deepcopy(d).eval()
    with torch.no_grad():
        out = ref_d(ref_g(batch[1]))
        want = nn.BCELoss()(out, torch.ones(BATCH))
    torch.testing.assert_close(metrics["loss"], want, **EXACT)
    assert len(g_calls) == 1 and s["g"].module.training  # back in training mode
    assert int(s["g"].buffers["main.1.num_batches_tracked"]) == 0  # no statistics updated


def test_check_step_accepts_a_step_with_a_shared_forward() -> None:
    g, d = models()

    def factory() -> fasttorch.Models:
        return state(g, d, adam_native)[0]

    # composes: grad_accumulate wraps the critic only (the generator owns "fake").
    got = fasttorch.testing.check_step(gan(), factory, data(2), checks=("composes",))
    assert got == {"composes": "ok"}


def test_a_member_splitting_the_call_is_refused_beside_a_shared_output() -> None:
    split = fasttorch.grad_accumulate(fasttorch.model_step(d_loss), 2)
    with pytest.raises(ValueError, match=r"\['d'\] split each call's batch.*across_calls=True"):
        fasttorch.several(
            {"d": split, "g": fasttorch.model_step(g_loss)}, outputs={"fake": ("g", make_fake)}
        )


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_an_owner_reading_neither_apply_nor_its_output_is_refused(compile: bool) -> None:
    # The owner may reach its parameters through its shared output instead of apply;
    # a loss that uses neither (the generator run as a copy) still trains nothing.
    g, d = models()
    copy_of_g = copy.deepcopy(g)

    def g_copy_loss(apply: Any, batch: Any, models: fasttorch.Peers) -> Any:
        real, noise = batch
        out = models["d"](copy_of_g(noise))
        return nn.BCELoss()(out, torch.ones(real.size(0)))

    step = fasttorch.several(
        {"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_copy_loss)},
        outputs={"fake": ("g", make_fake)},
    )
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    s, _ = state(g, d)
    with pytest.raises(ValueError, match="reached none of the state's parameters"):
        step(s, data(1)[0])


def test_each_call_backpropagates_its_own_shared_forward() -> None:
    """The kept graphs travel in the call's own scope, not a module-level table: a call
    made inside another call's loss (the same member names, its own shared forward) ends
    without dropping the outer call's graphs, and both equal their calls made alone
    (rule 1: the same operations on the same inputs)."""
    g, d = models()
    outer_batch, inner_batch = data(2)
    inner_step = gan()
    alone, _ = run(inner_step, state(g, d)[0], [inner_batch])
    inner_result: list[fasttorch.Models] = []

    def d_loss_calling_a_step(apply: Any, batch: Any, peers: fasttorch.Peers) -> Any:
        if not inner_result:
            inner_result.append(inner_step(state(g, d)[0], inner_batch)[0])
        return d_loss(apply, batch, peers)

    outer_step = fasttorch.several(
        {"d": fasttorch.model_step(d_loss_calling_a_step), "g": fasttorch.model_step(g_loss)},
        outputs={"fake": ("g", make_fake)},
    )
    outer, _ = run(outer_step, state(g, d)[0], [outer_batch])
    plain, _ = run(gan(), state(g, d)[0], [outer_batch])
    assert_close(tensors(outer), tensors(plain), 0.0)
    assert_close(tensors(inner_result[0]), tensors(alone), 0.0)
