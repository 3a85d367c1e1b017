"""``memtrain plan``: the fastest set-up that fits the budget, with its reasons (the model on the meta device)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

from memtrain.choices import default_global_batch
from memtrain.cli.console import EXIT_OK, echo, progress_lines
from memtrain.cli.flags import PLAN_PRECISION, UNLIMITED
from memtrain.cli.techniques import choices_from_flags, flags_for
from memtrain.cli.workloads import lora_flag_problems, lora_text, meta_target, trains_packed_rows
from memtrain.errors import ConfigError
from memtrain.planner import known_gpu, plan
from memtrain.planner.search import PROGRESS
from memtrain.quantize import fsdp_shards_4bit


def cmd_plan(args: argparse.Namespace) -> int:
    precision_reason = None  # --precision given: the plan says "(requested)"
    if args.precision is None:
        args.precision = PLAN_PRECISION
        precision_reason = (f"{PLAN_PRECISION}, because: memtrain plan's default (a GPU's bf16 autocast; memtrain "
                            "train picks fp32 on a CPU); pass --precision fp32 or fp16-mixed to plan another")
    problems = list(lora_flag_problems(args))  # every problem of the flags at once
    choices = ConfigError.gathered(problems, lambda: choices_from_flags(args))
    target = ConfigError.gathered(problems, lambda: meta_target(args))
    ConfigError.raise_if(problems)
    target, seq_len, name = target
    # memtrain plan's --compile fixes nothing: it lets the search weigh compiled set-ups too (plan(compile=)).
    choices = dataclasses.replace(choices, compile=False)
    # On the CPU the planner always probes; --calibrate probes a GPU now instead of the table of known ones.
    if args.gpu and (args.calibrate or args.device != "cuda"):
        other = "--calibrate" if args.calibrate else "--device cpu"
        why = " (which measures this machine's GPU instead)" if args.calibrate else ""
        raise ConfigError(f"--gpu {args.gpu!r} names the GPU to plan for from the table, which contradicts "
                          f"{other}{why}. To resolve this error, drop --gpu or {other}.")
    # Looked up now, not at import: tests substitute memtrain.planner.calibrate.
    from memtrain.planner import calibrate

    profile = calibrate(args.device, refresh=True) if args.calibrate else known_gpu(args.gpu) if args.gpu else None
    with progress_lines(PROGRESS.name, enabled=not (args.json or args.no_progress)):  # a large model: minutes
        p = plan(target, budget=None if args.budget == UNLIMITED else args.budget, seq_len=seq_len,
                 global_batch_size=args.global_batch_size or default_global_batch(args.nproc, args.micro_batch_size),
                 device=args.device, precision=args.precision, precision_reason=precision_reason,
                 world_size=args.nproc, compile=args.compile, choices=choices,
                 fsdp=_fsdp(args) if args.nproc > 1 else False,
                 host_budget=None if args.host_budget == UNLIMITED else args.host_budget,
                 micro_batch_size=args.micro_batch_size, device_profile=profile, packed=trains_packed_rows(args),
                 kept_share=args.kept_labels)
    if args.lora:
        p = dataclasses.replace(p, reasons=(lora_text(target, args.lora), *p.reasons))
    if args.json:
        echo(json.dumps(p.to_dict()))
    else:
        echo(f"{name}: {p.summary()}")
        # The plan's set-up as the flags that fix it: memtrain train with them (and the same model, batch and
        # budget) trains exactly this set-up.
        fixing = ["--micro-batch-size", str(p.settings.micro_batch_size)]
        if p.global_batch_size != default_global_batch(args.nproc, p.settings.micro_batch_size):
            # --micro-batch-size alone would make the global batch micro-batch x --nproc (no accumulation)
            fixing += ["--global-batch-size", str(p.global_batch_size)]
        if p.settings.precision != ("fp32" if args.device == "cpu" else "bf16-mixed"):
            # not what memtrain train's --precision auto picks there (fp32 on a CPU, bf16-mixed on a GPU)
            fixing += ["--precision", p.settings.precision]
        if p.settings.distribution == "fsdp2":  # memtrain train's ranks are DDP unless --fsdp
            fixing.append("--fsdp")
        fixing += flags_for(p.settings.choices)
        echo(f"  as flags: {shlex.join(fixing)}")
        echo(f"  planned in {p.plan_seconds:.1f} s")
    return EXIT_OK




def _fsdp(args: argparse.Namespace) -> bool | None:
    """--fsdp / --ddp, or None to compare both: not for QLoRA where this torch's FSDP2 cannot shard the 4-bit base
    (``fsdp_shards_4bit``; --fsdp is refused there)."""
    return False if args.quantize_base and args.fsdp is None and not fsdp_shards_4bit() else args.fsdp
