"""``memtrain estimate``: the peak memory of one given set-up, predicted on the meta device (no GPU)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from memtrain.cli.console import EXIT_OK, echo
from memtrain.cli.techniques import choices_from_flags
from memtrain.cli.workloads import lora_flag_problems, lora_text, meta_batch, meta_target, trains_packed_rows
from memtrain.device import active_simulation
from memtrain.errors import ConfigError
from memtrain.estimate import estimate
from memtrain.loss import supports_chunked_loss
from memtrain.report import format_bytes
from memtrain.techniques import REGISTRY, chunked_loss


def cmd_estimate(args: argparse.Namespace) -> int:
    if args.checkpointing == "auto":
        raise ConfigError("--checkpointing auto asks the planner to choose, and memtrain estimate predicts one given "
                          "set-up. To resolve this error, run memtrain plan --budget SIZE (it estimates its choice), "
                          "or pass a policy such as all, every:2 or none.")
    problems = list(lora_flag_problems(args))  # every problem of the flags at once
    setup = ConfigError.gathered(problems, lambda: choices_from_flags(args))
    problems += setup.precision_problems(args.precision, auto=False) if setup is not None else []
    target = ConfigError.gathered(problems, lambda: meta_target(args))
    ConfigError.raise_if(problems)
    target, seq_len, name = target
    setup = chunked_loss.with_unset_default(setup, supports_chunked_loss(target))
    report = estimate(target, meta_batch(args, args.micro_batch_size, seq_len), device=args.device,
                      precision=args.precision, setup=setup)
    if args.lora:
        report = dataclasses.replace(report, assumptions=(*report.assumptions, lora_text(target, args.lora)))
    if args.json:
        echo(json.dumps(report.to_dict()))
    else:
        techniques = ", ".join(text for technique in REGISTRY if (text := technique.setup_text(setup)))
        rows = " (packed rows)" if trains_packed_rows(args) else ""
        lora = f", LoRA rank {args.lora}" if args.lora else ""
        lora += f" on a 4-bit {args.quantize_base.upper()} base" if args.quantize_base else ""
        echo(f"{name}{lora}: batch {args.micro_batch_size} x {seq_len} tokens{rows}, {args.precision}, {techniques}, "
             f"on {_device_text(args.device)}")
        echo(report.summary())
    return EXIT_OK


def _device_text(device: str) -> str:
    """The device estimated for; a CUDA estimate under MEMTRAIN_SIMULATED_DEVICE is the simulated device's."""
    simulation = active_simulation() if device == "cuda" else None
    if simulation is None:
        return device
    return (f"the simulated device of {format_bytes(simulation.total_memory)} (MEMTRAIN_SIMULATED_DEVICE: the CPU's "
            "kernels, CUDA's allocator)")
