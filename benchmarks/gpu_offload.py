"""Activation offload side by side on the 1.1B Llama shape: checkpointing alone vs + offload, and the anchors.

Offloading a checkpointed block's input moves its bytes over PCIe instead of keeping them on the device; if the
copies hide behind compute, the step time stays that of checkpointing and the peak drops. Offloading a whole
block *instead of* recomputing it trades its recompute for many more bytes over PCIe. Cases, same model, data
and seed (docs/design.md's workload: fp32 weights, bf16 autocast, fp32 logits in the loss, fused AdamW):

1. ``checkpointing``: memtrain ``apply_checkpointing(model)``, every decoder layer (the baseline);
2. ``checkpointing + memtrain offload``: the same, each layer's saved input in pinned host memory (issue 5's
   target: <= 1.10x the baseline's step time, lower peak);
3. ``checkpointing + torch save_on_cpu``: the same inputs through torch's synchronous ``save_on_cpu``;
4. ``offload instead of recompute, first K layers``: layers 0..K-1 keep every activation on the host and are
   not recomputed; the other layers as in case 2 (K = 2 and 4);
5. ``no savings`` and ``memtrain offload, no checkpointing`` (every activation but the logits on the host),
   for reference.

``offloaded_bytes`` is what one step copies device -> host (each storage once), ``host_pool_bytes`` the pinned
pool, ``on_demand_fetches`` the copies back that backward waited for (neither prefetched nor still on the
device). Run on a GPU machine:
``.venv/bin/python benchmarks/gpu_offload.py`` (about 3 minutes on an H200). ``--small`` is a seconds-long
Llama that runs end to end on the CPU; there the offloader uses ``CpuTransport`` (plain copies into host slabs)
so every code path runs, but the timings say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from bench_checkpointing import SHAPES, Shape, build_model  # noqa: E402
from runner import Case, Result, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain import ConfigError, apply_checkpointing  # noqa: E402
from memtrain.offload import ActivationOffloader, CpuTransport, offload_activations  # noqa: E402

BASELINE = "checkpointing"


def _offloader(device: str, model: torch.nn.Module | None = None) -> ActivationOffloader:
    if device.startswith("cuda"):
        return offload_activations(model=model)
    # --small on the CPU: the same code path with plain copies (offload_activations would be a no-op there).
    return ActivationOffloader(CpuTransport(), model=model, min_bytes=4096, host_budget_bytes=2**28)


def _checkpoint_and_offload(model: torch.nn.Module, offloader: ActivationOffloader, first: int) -> None:
    """Every layer checkpointed with its saved input on the host, except the ``first`` layers: those keep every
    activation on the host and are not recomputed."""
    layers = [name for name, _ in model.named_modules() if name.count(".") == 2 and ".layers." in name]
    if "policies" in inspect.signature(apply_checkpointing).parameters:
        apply_checkpointing(model, offload=True, offloader=offloader,
                            policies=dict.fromkeys(layers[:first], "offload"))
        return
    # Until apply_checkpointing takes policies (issue 5's change to checkpointing.py): the same by hand, each
    # layer call run inside the offloader (a checkpointed one then offloads its saved inputs only).
    apply_checkpointing(model, blocks=layers[first:])
    modules = dict(model.named_modules())
    for name in layers:
        modules[name].forward = offloader.wrap(modules[name].forward)


def configure(name: str, model: torch.nn.Module, device: str) -> tuple[Callable[[], Any], ActivationOffloader | None]:
    """Applies case ``name`` to ``model``; returns the context the forward runs in, and the offloader if any."""
    if name == "no savings":
        return contextlib.nullcontext, None
    if name == "memtrain offload, no checkpointing":
        offloader = _offloader(device, model)
        return lambda: offloader, offloader
    if name == "checkpointing + memtrain offload" or name.startswith("offload instead of recompute"):
        offloader = _offloader(device)
        first = int(name.rsplit(" ", 2)[-2]) if name.startswith("offload instead") else 0
        _checkpoint_and_offload(model, offloader, first)
        return contextlib.nullcontext, offloader
    apply_checkpointing(model)
    if name == "checkpointing + torch save_on_cpu":
        pin = device.startswith("cuda")
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin), None
    return contextlib.nullcontext, None


CASES = [
    "checkpointing",
    "checkpointing + memtrain offload",
    "checkpointing + torch save_on_cpu",
    "offload instead of recompute, first 2 layers",
    "offload instead of recompute, first 4 layers",
    "no savings",
    "memtrain offload, no checkpointing",
]


def make_case(name: str, shape: Shape, device: str) -> Case:
    case = Case(name, setup=lambda: None)

    def setup() -> Callable[[], dict[str, Any]]:
        torch.manual_seed(0)
        model = build_model(shape, device)
        context, offloader = configure(name, model, device)
        cuda = device.startswith("cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), device=device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        case.notes = repr(offloader) if offloader is not None else ""
        last = {"bytes": 0, "fetches": 0}

        def step() -> dict[str, Any]:
            with autocast, context():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if offloader is None:
                return {}
            stats = offloader.stats()
            moved, last["bytes"] = stats.offloaded_bytes - last["bytes"], stats.offloaded_bytes
            waited, last["fetches"] = stats.fetched_on_demand - last["fetches"], stats.fetched_on_demand
            # on_demand_fetches: copies back that backward had to wait for (not prefetched, not still on device).
            return {"offloaded_bytes": moved, "host_pool_bytes": stats.host_reserved_bytes,
                    "on_demand_fetches": waited}

        return step

    case.setup = setup
    return case


def _parse(argv: list[str] | None) -> Any:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a seconds-long Llama, runnable on the CPU")
    parser.add_argument("--cases", default="", help=f"semicolon-separated subset of the cases (the baseline, "
                        f"{BASELINE!r}, is always run): {'; '.join(CASES)}")
    # Two warm-up steps: the first pins the host pool and records the backward order, the second uses it.
    parser.set_defaults(repeats=5, warmup=2)
    args = parser.parse_args(argv)
    problems = []
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device. To resolve "
                        "this error, run on a GPU machine, or pass --small --device cpu for a smoke run.")
    if not args.small and not args.device.startswith("cuda"):
        problems.append("the 1.1B Llama shape needs a GPU (~60 GiB and minutes per step on the CPU). To resolve "
                        "this error, pass --small for a CPU smoke run.")
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats {args.repeats} --warmup {args.warmup}: repeats must be >= 1 and warmup >= 0. "
                        "To resolve this error, pass e.g. --repeats 5 --warmup 2.")
    unknown = [c for c in _names(args.cases) if c not in CASES]
    if unknown:
        problems.append(f"--cases names no such case: {unknown}. To resolve this error, pick from {CASES}.")
    ConfigError.raise_if(problems)
    return args


def _names(text: str) -> list[str]:
    return [c.strip() for c in text.split(";") if c.strip()]


def main(argv: list[str] | None = None) -> list[Result]:
    args = _parse(argv)
    shape = SHAPES["tiny" if args.small else "llama-1.1b"]
    wanted = set(_names(args.cases)) | {BASELINE} if args.cases else set(CASES)
    cases = [make_case(name, shape, args.device) for name in CASES if name in wanted]
    title = f"offload-{'small' if args.small else 'llama-1.1b'}"
    path = Path(args.out) if args.out else Path("bench-results") / f"{title}.json"
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        results = run_side_by_side(cases, title=title, repeats=args.repeats, warmup=args.warmup, device=args.device,
                                   baseline=BASELINE, json_path=path, tokens_per_step=shape.tokens_per_step)
        print(f"(torch {torch.__version__}, {args.device}; {shape}; results in {path})")
    print_json_if_asked(args, path)
    return results


if __name__ == "__main__":
    main()
