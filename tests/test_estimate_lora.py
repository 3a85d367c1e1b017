"""estimate on LoRA models (PEFT adapters on the built-in GPT and on a Hugging Face Llama): the saved-activation bytes
equal measure's on the CPU, the loss included (a PEFT model's ``forward(*args, **kwargs)`` hides the GPT's
``targets``; the estimate reads the wrapped model's forward, so it computes the loss as training does)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama_config

from memtrain import measure
from memtrain.estimate import estimate
from memtrain.hf import apply_lora
from memtrain.models import GPT, GPT_PRESETS

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

B, T, V = 4, 64, 256


def _gpt():
    return GPT(GPT_PRESETS["gpt-tiny"])


def _llama():
    return transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=V, max_position_embeddings=128))


def _step(model, x):
    labels = x.clone()  # a training batch's labels are their own tensor
    if isinstance(model.get_base_model(), GPT):
        return lambda: model(x, labels)
    return lambda: model(input_ids=x, labels=labels)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
def test_lora_estimate_equals_measure_on_the_cpu(build, dropout, precision):
    torch.manual_seed(0)
    model = apply_lora(build(), 4, dropout=dropout)
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        measured = measure(_step(model, x), model=model)
    estimated = estimate(model, x, device="cpu", precision=precision)
    assert estimated.activation_bytes == measured.activation_bytes, (
        f"estimated {estimated.activation_bytes} saved bytes, measured {measured.activation_bytes} "
        f"({estimated.activation_bytes / measured.activation_bytes - 1:+.2%})")
    assert estimated.gradient_bytes == measured.gradient_bytes


def test_lora_reaches_the_user_without_its_peers_noise():
    """peft imports bitsandbytes where it is installed, whose import logs a CPU kernel it could not fetch from the
    Hugging Face Hub; get_peft_model asks transformers 5.2x by a deprecated name (a FutureWarning). Nothing a user
    acts on: neither reaches them (before, both printed on every LoRA plan). A fresh process: both come once, at the
    first import and the first adapters."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import warnings; warnings.simplefilter('error', FutureWarning); import transformers; "
            "from helpers import tiny_llama_config; from memtrain.hf import apply_lora; "
            "apply_lora(transformers.LlamaForCausalLM(tiny_llama_config()), 4)")
    root = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{root}:{root.parent}"})
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
