"""Reference models: shapes, losses, tied weights, presets, bad configs."""

from __future__ import annotations

import pytest
import torch

from memtrain import ConfigError
from memtrain.models import GPT, GPT_PRESETS, GPTConfig, ResNet


def test_gpt_logits_loss_and_tied_head():
    model = GPT.from_preset("gpt-tiny")
    x = torch.randint(0, 256, (2, 16))
    assert model(x).shape == (2, 16, 256)
    assert model.head.weight is model.wte.weight
    y = x.clone()
    y[:, :4] = -100  # ignored positions
    mean = model(x, y)
    total = model(x, y, reduction="sum")
    assert torch.allclose(mean * (y != -100).sum(), total, rtol=1e-5)
    untied = GPT(GPTConfig(tie_weights=False, n_layer=1))
    assert untied.head.weight is not untied.wte.weight


def test_gpt_learns_a_repeated_sequence():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.arange(16).repeat(4, 1) % 5
    first = None
    for _ in range(30):
        loss = model(x[:, :-1], x[:, 1:])
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first / 3, (first, loss.item())


def test_gpt_generate_and_bad_inputs():
    model = GPT.from_preset("gpt-tiny")
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8)
    with pytest.raises(ConfigError, match="longer than the model's seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ConfigError) as info:
        GPT(GPTConfig(n_embd=30, n_head=4, dropout=1.5))
    assert len(info.value.problems) == 2
    with pytest.raises(ConfigError, match="unknown GPT preset"):
        GPT.from_preset("gpt-huge")
    assert set(GPT_PRESETS) >= {"gpt-tiny", "gpt-mini", "gpt-small"}


def test_resnet_shapes_and_stages():
    model = ResNet(width=8, num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    widths = [stage[0].conv1.out_channels for stage in (model.layer1, model.layer2, model.layer3, model.layer4)]
    assert widths == [8, 16, 32, 64]
    assert [stage[0].conv1.stride[0] for stage in (model.layer1, model.layer2, model.layer3, model.layer4)] == [1, 2, 2, 2]
    big = ResNet(small_input=False, width=4)
    assert big(torch.randn(1, 3, 64, 64)).shape == (1, 10)
    with pytest.raises(ConfigError):
        ResNet(layers=(2, 2, 2))
