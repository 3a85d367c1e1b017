"""Optimizer offload on the 1.1B Llama shape with checkpointing: peak GiB and tokens/s, side by side.

The workload of docs/design.md: a Hugging Face ``LlamaForCausalLM`` from a config (hidden 2048, intermediate 5632,
22 layers, 32 heads, 4 KV heads, vocabulary 32000; random init, SDPA), batch 4 x 2048, fp32 weights, bf16
autocast, cross-entropy on fp32 logits, every decoder layer checkpointed with ``memtrain.apply_checkpointing``,
gradients clipped to 1.0. Cases:

- ``device AdamW``: ``torch.optim.AdamW(fused=True)`` on the GPU (the speed anchor; 16 bytes/param of state+grad);
- ``memtrain offload``: CPUOffloadOptimizer, gradients streamed to the host during backward;
- ``memtrain offload, delayed``: the same with ``delayed_update=True`` (the CPU step hides behind the next step);
- ``memtrain offload, step in backward``: ``step_in_next_backward()`` before each backward; it cannot clip, so this
  case (and only this one) runs without gradient clipping;
- ``memtrain offload, grads on device``: ``offload_gradients=False``;
- ``memtrain offload, bf16 weights``: bf16 weights on the GPU, fp32 master on the host (half the weight bytes);
- ``memtrain offload + chunked loss`` and ``memtrain offload, bf16 weights + chunked loss``: the same with
  ``apply_chunked_loss`` (the loss over 1024 tokens at a time: the 8192 x 32000 fp32 logits, 1 GiB, and their
  log-softmax are never held whole);
- ``torchao CPUOffloadOptimizer``: when torchao is importable (its ``offload_gradients=False``: clipping needs
  the gradients on the device);
- ``founding document``: the optimizer on the CPU with ``p.data``/``p.grad`` moved to the CPU and back each step.

Run on a GPU: ``.venv/bin/python benchmarks/gpu_optim_offload.py`` (about 5 minutes on an H200).
Run anywhere: ``.venv/bin/python benchmarks/gpu_optim_offload.py --small`` (a tiny Llama on the CPU: checks that
every case runs end to end; its times mean nothing).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain.checkpointing import apply_checkpointing  # noqa: E402
from memtrain.loss import apply_chunked_loss  # noqa: E402
from memtrain.optim import CPUOffloadOptimizer  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
MAX_NORM = 1.0
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)


def build_model(shape: dict[str, int], device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, attn_implementation="sdpa", use_cache=False)
    with torch.device(device):  # initialise on the GPU: a 1.1B random init on the CPU takes minutes
        model = LlamaForCausalLM(config).to(dtype)
    model.train()
    apply_checkpointing(model)
    return model


def torchao_class() -> type | None:
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            return importlib.import_module(module).CPUOffloadOptimizer
        except (ImportError, AttributeError):
            continue
    return None


class FoundingDocumentOffload:
    """The founding document's OffloadedOptimizer: parameters and gradients go to the CPU for the step and back."""

    def __init__(self, params: Any, **kwargs: Any):
        self.params = list(params)
        self.device = self.params[0].device
        self.optimizer = torch.optim.AdamW(self.params, **kwargs)  # its state is created on the CPU at step 1

    def step(self) -> None:
        for p in self.params:
            grad = p.grad
            p.data = p.data.cpu()
            p.grad = grad.cpu() if grad is not None else None
        self.optimizer.step()
        for p in self.params:
            p.data = p.data.to(self.device)
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def make_case(kind: str, shape: dict[str, int], batch: int, seq: int, device: str) -> Callable[[], Callable]:
    def setup() -> Callable[[], dict[str, Any]]:
        dtype = torch.bfloat16 if kind.startswith("offload-bf16") else torch.float32
        model = build_model(shape, device, dtype)
        chunked = kind.endswith("-chunked")
        if chunked:
            apply_chunked_loss(model)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g).to(device)
        y = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g).to(device)
        clip: Callable[[], Any]
        if kind == "device":
            opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
            clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
        elif kind.startswith("offload"):
            opt = CPUOffloadOptimizer(model.named_parameters(), delayed_update=kind == "offload-delayed",
                                      offload_gradients=kind != "offload-keep-grads", **HYPER)
            clip = lambda: opt.clip_grad_norm_(MAX_NORM)  # noqa: E731
            if kind == "offload-in-backward":
                clip = lambda: None  # noqa: E731
        elif kind == "torchao":
            opt = torchao_class()(model.parameters(), torch.optim.AdamW, offload_gradients=False, fused=True,
                                  **HYPER)
            clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
        else:
            opt = FoundingDocumentOffload(model.parameters(), **HYPER)
            clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()

        def step() -> dict[str, Any]:
            if kind == "offload-in-backward":
                opt.step_in_next_backward()
            with autocast:
                if chunked:  # y is already aligned with x: shift_labels, the same mean as below
                    loss = model(input_ids=x, labels=y, shift_labels=y).loss
                else:
                    logits = model(x).logits
            if not chunked:
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                del logits
            loss.backward()
            clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return {"loss": loss.item()}

        return step

    return setup


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny Llama on this machine's device (smoke run)")
    parser.add_argument("--cases", default="", help="semicolon-separated subset of case names to run")
    args = parser.parse_args()
    shape, batch, seq = (LLAMA_TINY, 2, 64) if args.small else (LLAMA_1B, 4, 2048)
    device = args.device
    cases = [
        Case("device AdamW", make_case("device", shape, batch, seq, device), notes="fused AdamW on the device"),
        Case("memtrain offload", make_case("offload", shape, batch, seq, device)),
        Case("memtrain offload, delayed", make_case("offload-delayed", shape, batch, seq, device),
             notes="delayed_update=True: one-step-stale updates"),
        Case("memtrain offload, step in backward", make_case("offload-in-backward", shape, batch, seq, device),
             notes="step_in_next_backward(): no gradient clipping"),
        Case("memtrain offload, grads on device", make_case("offload-keep-grads", shape, batch, seq, device)),
        Case("memtrain offload, bf16 weights", make_case("offload-bf16", shape, batch, seq, device),
             notes="bf16 weights on the device, fp32 master on the host"),
        Case("memtrain offload + chunked loss", make_case("offload-chunked", shape, batch, seq, device),
             notes="apply_chunked_loss: 1024 tokens of fp32 logits at a time"),
        Case("memtrain offload, bf16 weights + chunked loss",
             make_case("offload-bf16-chunked", shape, batch, seq, device),
             notes="bf16 weights on the device, fp32 master on the host, apply_chunked_loss"),
    ]
    if torchao_class() is not None:
        cases.append(Case("torchao CPUOffloadOptimizer", make_case("torchao", shape, batch, seq, device)))
    else:
        print("torchao is not importable: its case is left out", file=sys.stderr)
    cases.append(Case("founding document", make_case("founding", shape, batch, seq, device),
                      notes="p.data and p.grad to the CPU and back each step"))
    if args.cases:
        wanted = {c.strip() for c in args.cases.split(";")}
        cases = [c for c in cases if c.name in wanted]
    title = "gpu_optim_offload_small" if args.small else "gpu_optim_offload"
    run_side_by_side(cases, title=title, repeats=args.repeats, warmup=args.warmup, device=device,
                     json_path=args.out, tokens_per_step=batch * seq)
    print_json_if_asked(args, args.out or f"bench-results/{title}.json")


if __name__ == "__main__":
    main()
