"""compiled(cpu_gemm=...): bf16/fp16 CPU matrix products computed in float32, rounded once."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from reference import LayerNormNet, assert_params_close, batches, mse, reference_run
from tolerance import gamma, params_atol, reference_error, unit_roundoff
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.proxy_tensor import make_fx

import fasttorch
from fasttorch import _compat
from fasttorch._compile import cpu_gemm as _cpu_gemm
from fasttorch._compile.cpu_gemm import HalfGemmInFloat32, half_gemm_dtypes
from fasttorch._compile.inductor_options import _with_cpu_gemm

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _products(a, b, c, bias, ah, bh, ch):
    return (
        torch.mm(a, b),
        torch.addmm(bias, a, b),
        torch.bmm(c, c.transpose(1, 2)),
        torch.baddbmm(c, c, c.transpose(1, 2)),
        torch.mm(ah, bh),  # fp16: not asked for, left alone
        torch.mm(a.float(), b.float()),  # float32: left alone
        torch.bmm(ch, ch.transpose(1, 2)),
    )


def _inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 96, generator=g).bfloat16()
    b = torch.randn(96, 24, generator=g).bfloat16()
    c = torch.randn(3, 8, 8, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    return a, b, c, bias, a.half(), b.half(), c.half()


needs_pass = pytest.mark.skipif(
    not _compat.cpu_gemm_pass_works(),
    reason="compiled's float32 CPU pass needs torch >= 2.13 (_compat.cpu_gemm_pass_works)",
)


class Theirs(CustomGraphPass):
    """A caller's own post-grad pass, which only counts its calls."""

    calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "theirs"


def _product_bound(a, b):
    """Two bf16 results, each the float32 product rounded once to bf16: apart by at most
    the two roundings (relative ``2u``) plus twice Higham's bound of a float32 sum of
    ``k`` products (rule 3), as (rtol, atol) for ``a @ b``."""
    k = a.shape[-1]
    scale = float((a.float().abs() @ b.float().abs()).max())
    return 2 * unit_roundoff(torch.bfloat16), 2 * gamma(k) * scale


def _gemm_dtypes(graph):
    return sorted(
        str(n.meta["val"].dtype).removeprefix("torch.")
        for n in graph.nodes
        if n.op == "call_function" and n.target in GEMMS
    )


def test_pass_widens_bf16_products_and_rounds_once():
    args = _inputs()
    gm = make_fx(_products, tracing_mode="fake")(*args)
    before = _gemm_dtypes(gm.graph)
    assert before.count("bfloat16") == 4 and before.count("float16") == 2
    HalfGemmInFloat32([torch.bfloat16])(gm.graph)
    gm.recompile()
    after = _gemm_dtypes(gm.graph)
    assert "bfloat16" not in after and after.count("float16") == 2 and after.count("float32") == 5
    got = gm(*args)
    native = _products(*args)
    a, b, c, bias, *_ = (x.float() for x in args)
    exact = (
        torch.mm(a, b),
        torch.addmm(bias, a, b),
        torch.bmm(c, c.transpose(1, 2)),
        torch.baddbmm(c, c, c.transpose(1, 2)),
    )
    operands = ((a, b), (a, b), (c, c.transpose(1, 2)), (c, c.transpose(1, 2)))
    for i, want in enumerate(exact):
        assert got[i].dtype == torch.bfloat16
        assert torch.equal(got[i], want.bfloat16()), "float32 product, one rounding"
        # ATen's bf16 kernel sums in float32 too, in its own order, and rounds once
        rtol, atol = _product_bound(*operands[i])
        if i == 1:  # addmm adds the bias in float32: one more rounding of its size
            atol += 2 * gamma(1) * float(bias.abs().max())
        if i == 3:  # baddbmm adds c
            atol += 2 * gamma(1) * float(c.abs().max())
        torch.testing.assert_close(got[i], native[i], rtol=rtol, atol=atol)
    for i in (4, 5, 6):
        assert torch.equal(got[i], native[i]), "other dtypes are untouched"


def _saved(x_in, w, g):
    x = torch.relu(x_in)  # an activation, not an input
    y = torch.mm(x, w)  # the forward product
    return y, torch.mm(g, x.t()), torch.mm(x.t(), w.t())  # two backward-like uses of x


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def test_a_source_met_again_is_widened_again_right_before_its_use():
    """The first use of a source shares one widening made where the source is made; a
    later use (the backward's weight-gradient product) widens it again right before
    that product with an extern call, so no float32 copy outlives its product."""
    g = torch.Generator().manual_seed(0)
    x, w, gy = (torch.randn(8, 8, generator=g).bfloat16() for _ in range(3))
    gm = make_fx(_saved, tracing_mode="fake")(x, w, gy)
    HalfGemmInFloat32([torch.bfloat16])(gm.graph)
    gm.recompile()
    assert _gemm_dtypes(gm.graph) == ["float32"] * 3
    xr = torch.relu(x)
    pairs = ((xr, w), (gy, xr.t()), (xr.t(), w.t()))
    for (p, q), got, ref in zip(pairs, gm(x, w, gy), _saved(x, w, gy)):
        rtol, atol = _product_bound(p, q)  # each the float32 product rounded once
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    shared = [
        n
        for n in _calls(gm, torch.ops.prims.convert_element_type.default)
        if n.args[1] == torch.float32
    ]
    assert sorted(str(n.args[0]) for n in shared) == ["g_1", "relu", "w_1"], (
        "relu(x), w and gy: one shared float32 copy each, for their first use"
    )
    again = _calls(gm, torch.ops.fasttorch.widen.default)
    assert sorted(str(n.args[0]) for n in again) == ["relu", "relu", "w_1"], (
        "x in both later products, w in the last"
    )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in again:  # right before its product: only widenings and views in between
        product = n
        while product.target not in GEMMS:
            (product,) = product.users
        between = [m for m in order if order[n] < order[m] < order[product]]
        assert all(m.target in (*_cpu_gemm._VIEWS, n.target) for m in between), between


def _attention(q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def test_attention_runs_in_float32_and_is_closer_to_float32_than_aten_bf16():
    """ATen's bf16 CPU attention is several times slower than float32's (its backward
    most), and rounds the attention weights to bf16 before multiplying by V; float32
    from the same inputs, rounded once, is at least as close to exact."""
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(2, 3, 16, 8, generator=g).bfloat16() for _ in range(4))
    gm = make_fx(_attention, tracing_mode="fake")(q, k, v, go)
    names = (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )
    assert [len(_calls(gm, t)) for t in names] == [1, 1]
    HalfGemmInFloat32([torch.bfloat16])(gm.graph)
    gm.recompile()
    for t in names:
        (node,) = _calls(gm, t)
        assert {v.dtype for v in node.meta["val"]} == {torch.float32}
    # the backward's query, key, value and output come from the forward: widened again
    assert len(_calls(gm, torch.ops.fasttorch.widen.default)) == 4
    got = gm(q, k, v, go)
    native = _attention(q, k, v, go)
    exact = _attention(q.float(), k.float(), v.float(), go.float())
    assert torch.equal(got[0], exact[0].bfloat16()), "float32 forward, one rounding"
    for mine, aten_bf16, ref in zip(got, native, exact):
        assert mine.dtype == torch.bfloat16
        err = (mine.float() - ref).abs().max()
        # Rule 2 with ATen's bf16 attention as the reference: its own error against
        # float32 bounds ours, hence |mine - aten| <= 2 x that error, elementwise.
        assert err <= (aten_bf16.float() - ref).abs().max()


def test_pass_leaves_other_devices_alone():
    a, b, *_ = _inputs()
    gm = make_fx(torch.mm, tracing_mode="fake")(a.to("meta"), b.to("meta"))
    HalfGemmInFloat32([torch.bfloat16])(gm.graph)
    assert _gemm_dtypes(gm.graph) == ["bfloat16"]


def test_cpu_gemm_choices(monkeypatch):
    assert half_gemm_dtypes("native") == ()
    assert half_gemm_dtypes("fp32") == (torch.bfloat16, torch.float16)
    monkeypatch.setattr(_cpu_gemm, "native_cpu_gemm", lambda d: d == torch.float16)
    assert half_gemm_dtypes("auto") == (torch.bfloat16,)
    out = _with_cpu_gemm({"emulate_precision_casts": False}, "auto", "inductor")
    assert out is not None and out["emulate_precision_casts"] is False, "theirs wins"
    assert out["post_grad_custom_pre_pass"].dtypes == (torch.bfloat16,)
    assert _with_cpu_gemm(None, "auto", "inductor")["emulate_precision_casts"] is True
    monkeypatch.setattr(_cpu_gemm, "native_cpu_gemm", lambda d: True)
    assert half_gemm_dtypes("auto") == ()
    assert _with_cpu_gemm(None, "auto", "inductor") is None, "nothing to add, nothing added"
    with pytest.raises(ValueError, match="cpu_gemm must be"):
        fasttorch.compiled(fasttorch.step(mse), cpu_gemm="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="inductor graph pass"):
        fasttorch.compiled(fasttorch.step(mse), backend="aot_eager", cpu_gemm="fp32")
    # auto and native pass through other backends without complaint
    for choice in ("auto", "native"):
        assert _with_cpu_gemm({"x": 1}, choice, "aot_eager") == {"x": 1}


@needs_pass
def test_the_pass_runs_ahead_of_the_callers_own():
    theirs = Theirs()
    opts = {"post_grad_custom_pre_pass": theirs}
    out = _with_cpu_gemm(opts, "fp32", "inductor")
    assert out is not None
    combined = out["post_grad_custom_pre_pass"]
    first, second = combined.passes  # one pass object: inductor <= 2.12 calls it directly
    assert isinstance(first, HalfGemmInFloat32) and second is theirs
    graph = torch.fx.Graph()
    combined(graph)
    assert theirs.calls == 1, "the caller's pass runs inside the combined one"
    assert opts == {"post_grad_custom_pre_pass": theirs}, "the caller's dict is left as it was"
    assert HalfGemmInFloat32([torch.bfloat16]).uuid() != HalfGemmInFloat32([torch.float16]).uuid()


@needs_pass
@pytest.mark.slow
def test_compiled_bf16_step_with_float32_products_matches_native_and_the_hand_written_loop():
    """Inductor, bf16 autocast, accumulation and clipping.

    cpu_gemm="fp32" against cpu_gemm="native" (ATen's bf16 products in the same compiled
    step, under the same inductor rounding rules) to the bf16 equivalence bound; both
    against the plain loop with every bf16 rounding of the chain allowed to differ (its
    kernels round elementwise bf16 work differently from eager's; tests/README.md)."""
    seen = []

    class Spy(CustomGraphPass):
        def __call__(self, graph):
            seen.append(_gemm_dtypes(graph))

        def uuid(self):
            return None  # no graph cache: the passes must run

    import logging

    class Keep(logging.Handler):  # what inductor logs while building the C++ wrapper
        def emit(self, record):
            logged.append(record.getMessage())

    logged: list[str] = []
    handler = Keep()
    logging.getLogger("torch._inductor").addHandler(handler)
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(8, 16)
    windows = [data[i : i + 2] for i in range(0, 8, 2)]
    results = {}
    for choice in ("fp32", "native"):
        step = fasttorch.clip_scaled(
            fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(mse), "bf16"), 2), 1.0
        )
        # the same rounding rules in both (cpu_gemm="fp32" turns this on itself)
        # no FX graph cache: a warm one would skip the passes, Spy's included
        opts = {
            "post_grad_custom_pre_pass": Spy(),
            "emulate_precision_casts": True,
            "fx_graph_cache": False,
        }
        fast = fasttorch.compiled(step, cpu_gemm=choice, options=opts)
        state = fasttorch.TrainState.create(
            copy.deepcopy(model), fasttorch.optim.adamw(1e-2, weight_decay=0.1)
        )
        for w in windows:
            x, y = (torch.cat(t) for t in zip(*w))
            state, _ = fast(state, (x, y))
        results[choice] = state
        model_graph = max(seen, key=len)  # the microbatch graph: forward and backward
        assert len(model_graph) == 8, "3 forward, 5 backward products"
        assert set(model_graph) == {"float32" if choice == "fp32" else "bfloat16"}, seen
        seen.clear()

    def adamw(p):
        return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)

    ref, _ = reference_run(model, windows, make_opt=adamw, precision="bf16", clip=1.0)
    logging.getLogger("torch._inductor").removeHandler(handler)
    # The pass's extern widening has a C++ wrapper path without a "missing a c-shim"
    # warning (a custom op, not an ATen one), so a compile prints nothing of it.
    assert not [m for m in logged if "c-shim" in m], logged
    error = reference_error(model, windows, make_opt=adamw, clip=1.0)
    bf16 = {"precision": "bf16", "steps": len(windows), "lr": 1e-2}
    # Rules 2 + 4: the same inductor kernels, products rounded once either way.
    atol = params_atol(error.params, ref.state_dict(), **bf16)
    for k, p in results["fp32"].params.items():
        torch.testing.assert_close(p, results["native"].params[k], rtol=0, atol=atol)
    # Against eager, every bf16 rounding of the chain may differ: the 8 products counted
    # above; tanh and its gradient; the three casts to bf16 autocast puts on the chain
    # (forward: relu's float32 output into `hidden`; backward: the loss's float32
    # gradient into `out`'s bf16 output, LayerNorm's float32 input gradient into `inp`'s
    # bf16 output); the three bias gradients, sums of bf16 gradients (LayerNorm and relu
    # themselves run in float32). Counting only the first ten held on two threads and
    # not on one, where the reductions' order differs.
    atol = params_atol(error.params, ref.state_dict(), half_roundings=8 + 2 + 3 + 3, **bf16)
    for state in results.values():
        assert_params_close(state, ref, rtol=0, atol=atol)


@needs_pass
def test_a_step_with_no_cpu_tensor_is_compiled_without_the_pass():
    from fasttorch._compile.inductor_options import _without_cpu_only_passes

    theirs = Theirs()
    opts = {
        "backend": "inductor",
        "options": _with_cpu_gemm({"post_grad_custom_pre_pass": theirs}, "fp32", "inductor"),
    }
    on_gpu = ({"w": torch.empty(2, device="meta")}, torch.empty(3, device="meta"))
    stripped = _without_cpu_only_passes(opts, on_gpu)
    assert stripped["options"] == {"post_grad_custom_pre_pass": theirs}, "theirs is kept"
    on_cpu = ({"w": torch.empty(2)}, torch.empty(3, device="meta"))
    assert _without_cpu_only_passes(opts, on_cpu) is opts
    # a rounding option the caller set is the caller's: left as it was
    mine = {"emulate_precision_casts": False}
    kept = _without_cpu_only_passes({"options": _with_cpu_gemm(mine, "fp32", "inductor")}, on_gpu)
    assert kept["options"] == {"emulate_precision_casts": False}


def test_where_torch_cannot_run_the_pass_fp32_is_refused_and_auto_warns_on_cpu_only(monkeypatch):
    """Before torch 2.13 the pass fails to build or rounds differently: cpu_gemm='fp32'
    raises at wrap time; 'auto' drops it with one warning, at the first call and only
    when the step has CPU tensors (a GPU step never needs it)."""
    from fasttorch import _compat, steps
    from fasttorch._compile.inductor_options import _without_cpu_only_passes

    monkeypatch.setattr(_compat, "cpu_gemm_pass_works", lambda: False)
    with pytest.raises(ValueError, match="cpu_gemm='fp32' needs torch >= 2.13"):
        fasttorch.compiled(fasttorch.step(mse), cpu_gemm="fp32")
    opts = {"backend": "inductor", "options": _with_cpu_gemm(None, "auto", "inductor")}
    if not opts["options"]:
        pytest.skip("this CPU has bf16 and fp16 units: 'auto' adds no pass")
    steps.warn_once.cache_clear()
    on_gpu = ({"w": torch.empty(2, device="meta")},)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _without_cpu_only_passes(opts, on_gpu)["options"] == {}, "no pass, no warning"
    with pytest.warns(UserWarning, match="needs torch >= 2.13"):
        kept = _without_cpu_only_passes(opts, ({"w": torch.empty(2)},))
    assert kept["options"] == {}, "the pass and the rounding option it set are dropped"


def test_a_combined_pass_is_cached_only_if_every_part_is():
    """A part whose uuid is None asks inductor never to cache: the combination too."""
    from fasttorch._compat import CombinedGraphPass

    class Uncached(Theirs):
        def uuid(self):
            return None

    mine = HalfGemmInFloat32([torch.bfloat16])
    assert CombinedGraphPass([mine, Uncached()]).uuid() is None
    keyed = CombinedGraphPass([mine, Theirs()]).uuid()
    assert keyed is not None and keyed == CombinedGraphPass([mine, Theirs()]).uuid()
