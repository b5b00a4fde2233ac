"""The benchmark models and their synthetic data.

Every variant builds its model with :func:`build` (seeded, so the initial weights are
the same everywhere) and trains on the windows of :func:`windows` (seeded, so the data
are the same everywhere). A window is the whole batch of one optimizer step: the
fasttorch variants get it as one call and split it with ``grad_accumulate``; the
hand-written variants split it with ``tensor_split`` in their own loop.

* M1: a small, deep MLP (many small tensors): launch-overhead bound.
* M2: a small ConvNet with BatchNorm (running statistics as buffers).
* M3: a GPT (CPU: 2 layers, width 128, context 64; GPU: GPT-2 124M, context 1024).
* M4: a ResNet-50-class convnet (bottleneck blocks, BatchNorm, channels_last; GPU:
  ResNet-50's widths on 224x224 images; CPU: a quarter of the widths on 64x64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACCUM", "MODELS", "Spec", "build", "flops_per_window", "loss_fn", "spec", "windows"]

ACCUM = 4  # microbatches per optimizer step, in every variant
POOL = 8  # distinct synthetic windows, cycled


@dataclass(frozen=True)
class Spec:
    """Sizes of one model on one kind of device."""

    name: str
    title: str
    make: Callable[[], nn.Module]
    micro: int  # samples per microbatch; a window holds ACCUM of them
    sample: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    tokens_per_sample: int = 1
    gpt_shape: tuple[int, int, int] | None = None  # (layers, width, context), for FLOPs
    channels_last: bool = False  # model and images in torch.channels_last


class MLP(nn.Module):
    """``depth`` residual blocks ``x + W2 gelu(W1 LayerNorm(x))``: many small tensors."""

    def __init__(self, d_in: int = 64, width: int = 64, depth: int = 12, d_out: int = 10):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)
            )
            for _ in range(depth)
        )
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class ConvNet(nn.Module):
    """Three conv-BatchNorm-ReLU stages, global average pooling, a linear head."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        c = channels

        def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
            )

        self.features = nn.Sequential(stage(3, c, 1), stage(c, 2 * c, 2), stage(2 * c, 2 * c, 1))
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class Bottleneck(nn.Module):
    """ResNet's bottleneck: 1x1 down, 3x3 (strided), 1x1 up, BatchNorm after each."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """ResNet-50's layout (3, 4, 6, 3 bottlenecks) with base width ``width`` (64 in ResNet-50)."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers: list[nn.Module] = []
        cin = width
        for i, count in enumerate((3, 4, 6, 3)):
            mid = width * 2**i
            for j in range(count):
                layers.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
                cin = 4 * mid
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal SDPA attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's GPT: token + position embeddings, blocks, final LayerNorm, tied head."""

    def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as GPT-2
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.ndim == 2:
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "fc_out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _vectors(d_in: int, classes: int) -> Callable[[torch.Generator, int], Any]:
    def sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)

    return sample


def _images(size: int, classes: int) -> Callable[[torch.Generator, int], Any]:
    def sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 3, size, size, generator=g)
        return x, torch.randint(0, classes, (n,), generator=g)

    return sample


def _tokens(vocab: int, context: int) -> Callable[[torch.Generator, int], Any]:
    def sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, vocab, (n, context + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return sample


def _specs(device_type: str) -> dict[str, Spec]:
    gpu = device_type == "cuda"
    if gpu:
        gpt = Spec(
            "M3",
            "GPT-2 124M (12 layers, width 768, context 1024, vocab 50304)",
            lambda: GPT(vocab=50304, context=1024, layers=12, width=768, heads=12),
            micro=8,
            sample=_tokens(50304, 1024),
            tokens_per_sample=1024,
            gpt_shape=(12, 768, 1024),
        )
    else:
        gpt = Spec(
            "M3",
            "GPT (2 layers, width 128, 4 heads, context 64, vocab 256)",
            lambda: GPT(vocab=256, context=64, layers=2, width=128, heads=4),
            micro=4,
            sample=_tokens(256, 64),
            tokens_per_sample=64,
            gpt_shape=(2, 128, 64),
        )
    return {
        "M1": Spec(
            "M1",
            "MLP (12 residual blocks, width 64)",
            lambda: MLP(64, 64, 12, 10),
            micro=32 if gpu else 16,
            sample=_vectors(64, 10),
        ),
        "M2": Spec(
            "M2",
            "ConvNet with BatchNorm (3 conv stages, 16/32/32 channels, 16x16 inputs)",
            lambda: ConvNet(16, 10),
            micro=32 if gpu else 8,
            sample=_images(16, 10),
        ),
        "M3": gpt,
        # Not in the suite: GPT-2's 148 parameter tensors at toy sizes, for counting the
        # operations of a step (benchmarks/launches.py), where the tensor count matters.
        "M3x12": Spec(
            "M3x12",
            "GPT (12 layers, width 32, 2 heads, context 16, vocab 64): 148 tensors",
            lambda: GPT(vocab=64, context=16, layers=12, width=32, heads=2),
            micro=2,
            sample=_tokens(64, 16),
            tokens_per_sample=16,
            gpt_shape=(12, 32, 16),
        ),
        "M4": Spec(
            "M4",
            "ResNet-50 (BatchNorm, channels_last, 224x224 images, 1000 classes)"
            if gpu
            else "ResNet-50 layout at 1/4 width (BatchNorm, channels_last, 64x64 images)",
            (lambda: ResNet(64, 1000)) if gpu else (lambda: ResNet(16, 100)),
            micro=64 if gpu else 2,
            sample=_images(224, 1000) if gpu else _images(64, 100),
            channels_last=True,
        ),
    }


MODELS = ("M1", "M2", "M3", "M4")


def spec(model: str, device_type: str) -> Spec:
    """The sizes of ``model`` (one of :data:`MODELS`) for ``device_type`` ("cpu", "cuda")."""
    return _specs(device_type)[model]


def build(model: str, device: torch.device, seed: int = 0) -> nn.Module:
    """The model with the same initial weights in every variant (seeded)."""
    torch.manual_seed(seed)
    s = spec(model, device.type)
    module = s.make().to(device)
    return module.to(memory_format=torch.channels_last) if s.channels_last else module


def windows(
    model: str, device: torch.device, n: int = POOL, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` synthetic windows of ``ACCUM`` microbatches each, the same in every variant."""
    s = spec(model, device.type)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = (t.to(device) for t in s.sample(g, ACCUM * s.micro))
        if s.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x, y))
    return out


def loss_fn(apply: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean cross-entropy; the logits are cast to float32 (as under autocast)."""
    x, y = batch
    logits = apply(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def flops_per_window(model: str, device_type: str, n_params: int) -> float | None:
    """Model FLOPs of one optimizer step (forward + backward): 6N per token + attention.

    PaLM's / nanoGPT's count, ``6 N + 12 L d T`` per token; ``None`` for the models
    that are not a GPT (MFU is reported for M3 only).
    """
    s = spec(model, device_type)
    if s.gpt_shape is None:
        return None
    layers, width, context = s.gpt_shape
    tokens = ACCUM * s.micro * s.tokens_per_sample
    return (6.0 * n_params + 12.0 * layers * width * context) * tokens
