"""Activation checkpointing side by side: memtrain vs Hugging Face vs none, on a Hugging Face Llama.

Recomputing each decoder layer in backward costs about one extra forward pass of time and keeps only the layer
inputs; this benchmark measures both sides of that trade on the same model, data and seed:

1. no checkpointing (the baseline),
2. Hugging Face ``model.gradient_checkpointing_enable()`` (transformers 5: non-reentrant, ``use_reentrant=False``;
   the table's notes show the value read back from the model),
3. memtrain ``apply_checkpointing(model)`` (every decoder layer),
4. memtrain ``apply_checkpointing(model)`` + ``apply_chunked_loss(model)`` (the loss over 1024 tokens at a time,
   their logits recomputed in backward: with the layers checkpointed, the loss's fp32 log-softmax is the largest
   saved tensor left),
5. memtrain ``apply_checkpointing(model, every=2)``,
6. memtrain ``apply_checkpointing(model, selective=("matmul", "attention"))``.

A step is forward with labels (Hugging Face's loss upcasts the logits to fp32), backward, AdamW step,
``zero_grad(set_to_none=True)``. Saved-activation bytes are measured exactly with ``MemoryMeter`` around forward on
one untimed step that ``setup`` runs (it is also the warm-up that creates the optimizer state): the meter's hooks
never run in a timed step, so they slow no case. ``reduction`` is the baseline's bytes over the case's bytes;
``loss`` is the last timed step's (equal across cases: checkpointing changes what is kept, not what is computed);
``cpu_s`` (CPU only) is the median process CPU time per step, a second view beside wall time when other processes
load the machine.

Shapes (``--shape``): ``cpu-llama`` (issue 2: hidden 256, 8 layers, batch 8 x 256, fp32; default) and
``llama-1.1b`` (docs/design.md's GPU workload: batch 4 x 2048, fp32 weights, bf16 autocast and fused AdamW on CUDA;
the runner adds the allocator peak). ``--tiny`` is a seconds-long shape for smoke tests. ``--compile`` runs every case
through ``torch.compile`` (after its checkpointing), the anchor docs/design.md calls strongest.

Run: ``.venv/bin/python benchmarks/bench_checkpointing.py`` or ``memtrain bench checkpointing``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from runner import Case, Result, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain import ConfigError, MemoryMeter, apply_checkpointing  # noqa: E402
from memtrain.loss import apply_chunked_loss  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A Llama configuration and the batch it trains on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


SHAPES: dict[str, Shape] = {
    # issue 2's CPU comparison
    "cpu-llama": Shape(hidden=256, intermediate=688, layers=8, heads=8, kv_heads=4, vocab=2048, batch=8, seq_len=256),
    # docs/design.md's reference GPU workload ("the 1.1B Llama shape")
    "llama-1.1b": Shape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, batch=4,
                        seq_len=2048),
    # smoke tests: a second or two for all six cases
    "tiny": Shape(hidden=32, intermediate=64, layers=4, heads=4, kv_heads=2, vocab=128, batch=2, seq_len=16),
}


def build_model(shape: Shape, device: str) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` with SDPA attention, built directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.seq_len,
        attn_implementation="sdpa",
        # Training needs no KV cache; off for every case alike, so the baseline does not fill one either.
        use_cache=False,
    )
    # Built on the device: initialising 1.1B parameters on the host first would take longer than the benchmark.
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.train()


def _hf_checkpointing(model: torch.nn.Module) -> None:
    with warnings.catch_warnings():
        # transformers 5 renamed it activation_checkpointing_enable; the old name is what users call, and the same.
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()


def hf_use_reentrant() -> str:
    """The ``use_reentrant`` Hugging Face's checkpointing passes to torch, read back from a one-layer model."""
    model = build_model(Shape(hidden=8, intermediate=16, layers=1, heads=1, kv_heads=1, vocab=8, batch=1,
                              seq_len=4), "cpu")
    _hf_checkpointing(model)
    funcs = {getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()} - {None}
    values = {getattr(f, "keywords", {}).get("use_reentrant", "torch default") for f in funcs}
    return ", ".join(sorted(map(str, values)))


def _checkpointing_and_chunked_loss(model: torch.nn.Module) -> None:
    apply_checkpointing(model)
    apply_chunked_loss(model)  # the loss's fp32 logits, 1024 tokens at a time: left after the layers


@dataclass(frozen=True)
class Configuration:
    """One way of checkpointing the model, and how the table's notes describe it."""

    apply: Callable[[torch.nn.Module], Any]
    notes: str


CONFIGURATIONS: dict[str, Configuration] = {
    "no checkpointing": Configuration(lambda model: None, "baseline"),
    "hf gradient_checkpointing_enable": Configuration(_hf_checkpointing, "model.gradient_checkpointing_enable()"),
    "memtrain full": Configuration(apply_checkpointing, "apply_checkpointing(model)"),
    "memtrain full + chunked loss": Configuration(_checkpointing_and_chunked_loss,
                                                  "apply_checkpointing(model); apply_chunked_loss(model)"),
    "memtrain every=2": Configuration(lambda model: apply_checkpointing(model, every=2),
                                      "apply_checkpointing(model, every=2)"),
    "memtrain selective(matmul,attention)": Configuration(
        lambda model: apply_checkpointing(model, selective=("matmul", "attention")),
        'apply_checkpointing(model, selective=("matmul", "attention"))'),
}
BASELINE = "no checkpointing"


def make_case(name: str, shape: Shape, device: str, measured: dict[str, int], compiled: bool = False) -> Case:
    """A case whose ``setup`` builds the model, applies ``name``'s checkpointing and runs one measured step.

    ``measured`` collects each case's saved-activation bytes, so later cases can report their reduction
    against the baseline (the runner sets up the baseline first).
    """
    configuration = CONFIGURATIONS[name]
    notes = configuration.notes
    if configuration.apply is _hf_checkpointing:
        notes += f" (use_reentrant={hf_use_reentrant()})"

    def setup() -> Callable[[], dict[str, Any]]:
        torch.manual_seed(0)
        model = build_model(shape, device)
        configuration.apply(model)
        # torch.compile after the technique, as a user would: the compiled graph recomputes what it checkpoints.
        forward = torch.compile(model) if compiled else model
        cuda = device.startswith("cuda")
        # fp32 weights; on CUDA bf16 autocast as in docs/design.md's workload (the loss still upcasts logits to fp32).
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
        data = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=data).to(device)
        # Hugging Face shifts the labels inside its loss, so the labels are the inputs themselves.
        labels = input_ids

        def train_step(meter: MemoryMeter | None = None) -> torch.Tensor:
            with autocast(), meter or contextlib.nullcontext():
                loss = forward(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        # The one measured step: the meter's saved-tensor hooks run here only, never in a timed step.
        meter = MemoryMeter(model)
        train_step(meter)
        activation_bytes = meter.activation_bytes
        measured[name] = activation_bytes

        cpu_seconds: list[float] = []

        def step() -> dict[str, Any]:
            start = time.process_time()
            loss = train_step().item()
            cpu_seconds.append(time.process_time() - start)
            figures: dict[str, Any] = {"activation_bytes": activation_bytes, "loss": loss}
            if not cuda:
                # CPU time of this process (all threads), median so far: a second view beside wall time on a
                # shared machine, where other processes' load stretches wall time unevenly.
                figures["cpu_s"] = statistics.median(cpu_seconds)
            base = measured.get(BASELINE)
            if base and activation_bytes:
                figures["reduction"] = base / activation_bytes
            return figures

        return step

    return Case(name, setup, notes=notes)


def _parse(argv: list[str] | None) -> Any:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"],
                        help="cpu-llama (issue 2, default) or llama-1.1b (docs/design.md's GPU workload)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long shape, for smoke tests")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every case's model after its checkpointing (docs/design.md's strongest anchor)")
    parser.add_argument("--cases", default="", help="semicolon-separated subset of the cases (the baseline always runs)")
    # 7 timed steps per case keep the CPU run under about two minutes on 2 cores.
    parser.set_defaults(repeats=7, warmup=0)
    args = parser.parse_args(argv)
    problems = []
    if args.tiny and args.shape:
        problems.append(f"--tiny and --shape {args.shape} both choose the shape. To resolve this error, pass one.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device. To resolve "
                        "this error, pass --device cpu.")
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats {args.repeats} --warmup {args.warmup}: repeats must be >= 1 and warmup >= 0. "
                        "To resolve this error, pass e.g. --repeats 5 --warmup 0.")
    unknown = [c for c in filter(None, (c.strip() for c in args.cases.split(";"))) if c not in CONFIGURATIONS]
    if unknown:
        problems.append(f"--cases: unknown {unknown}. To resolve this error, pick from {list(CONFIGURATIONS)}.")
    ConfigError.raise_if(problems)
    args.shape = "tiny" if args.tiny else args.shape or "cpu-llama"
    return args


def main(argv: list[str] | None = None) -> list[Result]:
    args = _parse(argv)
    shape = SHAPES[args.shape]
    if args.shape == "llama-1.1b" and not args.device.startswith("cuda"):
        print("Hint: llama-1.1b is the GPU workload; on the CPU a step takes minutes and tens of GiB. "
              "Pass --device cuda on a GPU machine, or --shape cpu-llama.", file=sys.stderr)
    measured: dict[str, int] = {}
    wanted = {c.strip() for c in args.cases.split(";") if c.strip()} | {BASELINE}
    names = [name for name in CONFIGURATIONS if not args.cases or name in wanted]
    cases = [make_case(name, shape, args.device, measured, args.compile) for name in names]
    title = f"checkpointing-{args.shape}{'-compiled' if args.compile else ''}"
    path = Path(args.out) if args.out else Path("bench-results") / f"{title}.json"
    # With --json, stdout carries only the JSON document: the table goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        results = run_side_by_side(
            cases,
            title=title,
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
            baseline=BASELINE,
            json_path=path,
            tokens_per_step=shape.tokens_per_step,
        )
        for case in cases:
            print(f"  {case.name}: {case.notes}")
        print(f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}; {shape}; "
              f"results in {path})")
    print_json_if_asked(args, path)
    return results


if __name__ == "__main__":
    main()
