"""A Hugging Face ``transformers`` causal LM, built from a small config (random weights,
nothing downloaded), trained by a composed step: the same as the hand-written loop.

GPT-2 ties its head to the token embedding; Llama keeps its rotary frequencies as
buffers (``rotary_emb.inv_freq``). Skipped when transformers is not installed
(``pip install 'fasttorch[hf]'``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

# Nothing may be fetched: the models are built from configs, and this makes any attempt
# to reach the Hub fail instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from reference import assert_buffers_close, assert_params_close, reference_run  # noqa: E402
from tolerance import loss_atol, params_atol, reference_error, split_mean_atol  # noqa: E402

import fasttorch  # noqa: E402

STEPS, N, VOCAB = 5, 4, 64


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers())
    return model


def loss_fn(apply, ids):
    """Next-token cross-entropy in float32 (``apply`` is the model, or its forward)."""
    logits = apply(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
    )


def loss_in_dtype(apply, ids):
    """``loss_fn`` in the logits' dtype when wider than float32 (the float64 run)."""
    logits = apply(input_ids=ids).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# SGD with momentum, not Adam: GPT-2's attention key biases have a true gradient of zero
# (softmax ignores a shift shared by all keys), so theirs is rounding noise, and Adam's
# normalisation turns noise into lr-sized steps of random sign (DESIGN.md); SGD keeps it
# at rounding size.
LR, MOMENTUM, CLIP = 0.1, 0.9, 1.0


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def bf16_atol() -> float:
    """A bf16 forward rounds differently when a weight differs by float32 rounding: each
    gradient element then moves by up to bf16's eps times the element (at most ``CLIP``
    after clipping), and momentum SGD adds ``lr`` times the sum over steps of the
    momentum buffer's weights (1, 1 + 0.9, ...)."""
    weight = sum(sum(MOMENTUM**j for j in range(t + 1)) for t in range(STEPS))
    return LR * weight * torch.finfo(torch.bfloat16).eps * CLIP


@pytest.mark.parametrize(
    ("precision", "mode"), [("fp32", "eager"), ("bf16", "eager"), ("bf16", "compiled")]
)
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2-tied", "llama-rotary"])
def test_causal_lm_matches_the_reference_loop(make, precision, mode):
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    # Counting sequences from random starts: the next token is learnable.
    starts = [torch.randint(0, VOCAB, (16, 1), generator=g) for _ in range(STEPS)]
    calls = [(start + torch.arange(16)) % VOCAB for start in starts]
    windows = [list(ids.tensor_split(N)) for ids in calls]
    ref, log = reference_run(
        model, windows, loss_fn=loss_fn, make_opt=sgd, precision=precision, clip=CLIP
    )
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), fasttorch.optim.sgd(LR, momentum=MOMENTUM)
    )
    step = fasttorch.step(loss_fn)
    if precision == "bf16":
        step = fasttorch.with_amp(step, "bf16")
    step = fasttorch.clip_scaled(fasttorch.grad_accumulate(step, N), CLIP)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    losses = []
    for ids in calls:
        state, metrics = step(state, ids)
        losses.append(metrics["loss"])
    assert int(state.step) == STEPS
    # Rule 2: the fp32 loop's own error against float64 (the same loop, loss in the
    # model's dtype); bf16 adds its own rule, bf16_atol (rule 4 for momentum SGD).
    error = reference_error(model, windows, make_opt=sgd, loss_fn=loss_in_dtype, clip=CLIP)
    atol = params_atol(error.params, state.params) + (bf16_atol() if precision == "bf16" else 0)
    assert_params_close(state, ref, rtol=0, atol=atol)  # one entry per tied pair
    assert_buffers_close(state, ref, atol=0)  # the rotary frequencies, untouched: bitwise
    ref_losses = torch.tensor([r["loss"] for r in log])
    torch.testing.assert_close(
        torch.stack(losses), ref_losses, rtol=0, atol=loss_atol(error, ref_losses, precision)
    )
    assert losses[-1] < losses[0]
    if make is gpt2:
        assert "lm_head.weight" not in state.params  # trained once, through the embedding
        trained = copy.deepcopy(model)
        trained.load_state_dict({**state.params, **state.buffers}, strict=False)
        assert trained.lm_head.weight is trained.transformer.wte.weight


def test_the_models_own_loss_compiles_once_its_loss_type_is_set():
    """``apply(input_ids=ids, labels=ids).loss`` under compiled, as docs/translation.md
    shows it. GPT-2's class names no ``loss_type``; transformers 5.x then warns from
    inside the forward (``logger.warning_once``), which dynamo refuses, unless the
    model's ``loss_type`` is set first."""
    torch.manual_seed(0)
    model = gpt2()
    model.loss_type = "ForCausalLM"  # what docs/translation.md says to set

    def own_loss(apply, ids):
        return apply(input_ids=ids, labels=ids).loss

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the same mean, from the logits, before the update
        logits = model(input_ids=ids).logits[:, :-1].flatten(0, 1).float()
        terms = torch.nn.functional.cross_entropy(logits, ids[:, 1:].flatten(), reduction="none")
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(LR))
    step = fasttorch.compiled(fasttorch.step(own_loss), backend="aot_eager")
    state, metrics = step(state, ids)
    assert int(state.step) == 1
    # Rule 3: one mean of the same terms, summed in two orders.
    terms = terms / terms.numel()
    atol = split_mean_atol(terms)
    torch.testing.assert_close(metrics["loss"], terms.sum(), rtol=0, atol=atol)
