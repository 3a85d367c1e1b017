"""Reference models: a decoder-only GPT and the founding document's checkpointed ResNet, done right.

Both are plain ``nn.Module``s with their repeated blocks in an ``nn.ModuleList`` / ``nn.Sequential``, so
``apply_checkpointing(model)`` finds them with no arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import memtrain.loss
from memtrain.errors import ConfigError
from memtrain.message import arg


# -- GPT ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer. Activation bytes grow with batch x seq_len x n_embd x n_layer."""

    vocab_size: int = 256  # byte-level by default: the built-in corpus needs no tokenizer
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_weights: bool = True  # True shares the embedding with the head: fewer parameters
    bias: bool = True

    def validate(self) -> None:
        problems = []
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                problems.append(f"GPTConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            problems.append(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}. To resolve "
                            "this error, pick n_head dividing n_embd.")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"GPTConfig.dropout={self.dropout} must be in [0, 1).")
        ConfigError.raise_if(problems)


GPT_PRESETS: dict[str, GPTConfig] = {
    # For tests: a forward and backward in milliseconds.
    "gpt-tiny": GPTConfig(seq_len=64, n_layer=2, n_head=2, n_embd=32),
    # The built-in job of `memtrain train`: a few minutes on 2 CPU cores.
    "gpt-mini": GPTConfig(seq_len=128, n_layer=4, n_head=4, n_embd=128),
    # GPT-2 small's shape at byte level, for machines with a GPU.
    "gpt-small": GPTConfig(seq_len=512, n_layer=12, n_head=12, n_embd=768),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # mask (batch, 1, T, T), True where attending is allowed: causal within each packed document.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: the unit ``apply_checkpointing`` recomputes."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer with causal SDPA attention (GPT-2 layout, nanoGPT-style).

    ``forward(idx)`` returns logits; ``forward(idx, targets)`` returns the cross-entropy on fp32 logits
    (``reduction="sum"`` for token-count-correct accumulation; labels of -100 are ignored).
    ``forward(..., segments=ids)`` takes rows packed with several documents (``data.PackCollate``): each position
    attends only within its own document and positions restart at each document's start, so a packed row computes
    what its documents would compute padded one per row.

    Example:
        >>> model = GPT(GPT_PRESETS["gpt-tiny"])
        >>> idx = torch.randint(0, 256, (2, 16))
        >>> model(idx).shape
        torch.Size([2, 16, 256])
    """

    # How memtrain.loss recognises this model (without importing this module): its output head is ``head``, its
    # chunked loss is on while ``loss_chunk_tokens`` is set, and ``forward(x, y, reduction="sum")`` is its loss.
    memtrain_gpt: ClassVar[bool] = True

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        config = config or GPTConfig()
        config.validate()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Set by memtrain.loss.apply_chunked_loss: the loss then never holds the whole batch's fp32 logits.
        self.loss_chunk_tokens: int | None = None
        if config.tie_weights:
            self.head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> GPT:
        """Builds a preset ("gpt-tiny", "gpt-mini", "gpt-small"), optionally with fields replaced."""
        if name not in GPT_PRESETS:
            raise ConfigError(f"unknown GPT preset {name!r}. To resolve this error, pick one of {sorted(GPT_PRESETS)}.")
        return cls(replace(GPT_PRESETS[name], **overrides))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, reduction: str = "mean",
                segments: torch.Tensor | None = None, kept: int | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ConfigError(f"sequence of {T} tokens is longer than the model's "
                              f"{arg('seq_len', text=str(self.config.seq_len))}. To resolve this error, build the "
                              f"model with a larger {arg('seq_len')} or cut the input.")
        if segments is None:
            pos, mask = torch.arange(T, device=idx.device), None
        else:
            pos, mask = _packed_positions_and_mask(segments, idx.shape)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        if targets is not None and self.loss_chunk_tokens is not None and reduction in ("sum", "mean") \
                and torch.is_grad_enabled():
            # memtrain.loss's at call time, as before the top-level import (tests replace it there)
            # kept: the targets that are not -100, counted on the host (only those reach the head)
            total = memtrain.loss.chunked_cross_entropy(self.ln_f(x), self.head, targets,
                                                        chunk_tokens=self.loss_chunk_tokens, kept=kept)
            return total if reduction == "sum" else total / (targets != -100).sum()
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # fp32 logits for the loss: a bf16 softmax over the vocabulary loses precision.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Samples ``max_new_tokens`` tokens after ``idx`` (batch x time), one at a time."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.seq_len:])[:, -1, :] / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits.float(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def _packed_positions_and_mask(segments: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions restarting at each document and the (batch, 1, T, T) causal, same-document attention mask."""
    if segments.shape != shape or segments.dtype.is_floating_point:
        raise ConfigError(f"segments of shape {tuple(segments.shape)} ({segments.dtype}) must be integer document ids "
                          f"of the input's shape {tuple(shape)}. To resolve this error, pass the batch's segments "
                          "from PackCollate.")
    T = shape[1]
    index = torch.arange(T, device=segments.device)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start_index = torch.where(starts, index, 0).cummax(dim=1).values
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return index - start_index, (same & causal).unsqueeze(1)


@torch.no_grad()
def sample_text(model: nn.Module, prompt: str, n: int, seq_len: int, *, seed: int = 0, tokenizer: Any = None) -> str:
    """``n`` tokens sampled after ``prompt`` (top-k 20): bytes decoded as UTF-8 with replacement, or the
    tokenizer's tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = tokenizer.encode(prompt) if tokenizer is not None else list(prompt.encode())
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        out = model(idx[:, -seq_len:])
        logits = getattr(out, "logits", out)[:, -1, :].float()
        if tokenizer is None:
            logits = logits[:, :256]  # bytes
        kth = torch.topk(logits, min(20, logits.shape[-1])).values[:, [-1]]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    if tokenizer is not None:
        return tokenizer.decode(idx[0].tolist())
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -- ResNet -------------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a (projected when the shape changes) shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with BasicBlock stages of widths w, 2w, 4w, 8w (64-128-256-512 by default) and strides 1, 2, 2, 2.

    ``layers=(2, 2, 2, 2)`` is ResNet-18. ``small_input=True`` uses a 3x3 stem for 32x32 images (CIFAR);
    ``False`` the 7x7 stride-2 stem and max-pool for 224x224 images.

    Example:
        >>> model = ResNet(layers=(1, 1, 1, 1), width=8, num_classes=10)
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, layers: tuple[int, int, int, int] = (2, 2, 2, 2), *, num_classes: int = 10, width: int = 64,
                 in_channels: int = 3, small_input: bool = True):
        super().__init__()
        if len(layers) != 4 or min(layers) < 1 or width < 1 or num_classes < 1:
            raise ConfigError(f"ResNet(layers={layers}, width={width}, num_classes={num_classes}): layers needs four "
                              "counts >= 1, width and num_classes >= 1. To resolve this error, use e.g. (2, 2, 2, 2).")
        if small_input:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        channels = width
        stages = []
        for i, (count, stride) in enumerate(zip(layers, (1, 2, 2, 2), strict=True)):
            out_channels = width * 2**i
            blocks = [BasicBlock(channels, out_channels, stride)]
            blocks += [BasicBlock(out_channels, out_channels) for _ in range(count - 1)]
            stages.append(nn.Sequential(*blocks))
            channels = out_channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))
