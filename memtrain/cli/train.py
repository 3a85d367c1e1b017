"""``memtrain train``: the checks that need no model first, then the model and the data the flags name, train(),
and the summary line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from memtrain.accumulation import accumulation_steps
from memtrain.choices import Choices, default_global_batch
from memtrain.cli.console import EXIT_OK, EXIT_STOPPED, echo, log, third_party_progress
from memtrain.cli.export import export_finished_run
from memtrain.cli.launch import distributed_group, nproc_problems
from memtrain.cli.resume import command_record, held_out_fraction, resume_flags
from memtrain.cli.techniques import choices_from_flags
from memtrain.cli.terms import DATA_PATH, HF_MODEL_PATH, call_site_flags, in_flag_terms
from memtrain.cli.workloads import (
    build_language_model,
    check_data_path,
    check_vocabulary,
    frozen_dtype_text,
    hf_folder_config,
    hf_seq_len,
    lora_flag_problems,
    quantized_text,
    start_up_notes,
)
from memtrain.config import TrainConfig, TrainResult
from memtrain.data import ByteWindows, split_windows, stdlib_corpus, text_file_tokens, tokenized_rows
from memtrain.data.packed_rows import file_rows
from memtrain.device import accelerator
from memtrain.device.allocator import configure_allocator
from memtrain.errors import ConfigError
from memtrain.hf import load_tokenizer, safetensors_files
from memtrain.report import format_bytes
from memtrain.run import RunFolder


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser, explicit: set[str]) -> int:
    """memtrain train: the checks, the model and the data the flags name, train(), and the summary line."""
    if args.resume and args.out and not args.overwrite and export_finished_run(args, explicit):
        return EXIT_OK  # the run had finished training: only its missing exports were written
    # The checks that need no model come first: a bad folder or file fails in a second, not after set-up.
    notes, tokenizer, choices = _check_before_set_up(args, parser, explicit)
    name = Path(args.hf_model).name if args.hf_model else Path(args.hf_config).stem if args.hf_config else args.model
    out = args.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = TrainConfig(
        max_steps=None if args.epochs else args.max_steps, epochs=args.epochs, micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule, adam_betas=tuple(args.adam_betas), adam_eps=args.adam_eps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        precision=args.precision, budget=args.budget, host_budget=args.host_budget, fsdp=args.fsdp,
        merge_lora=args.merge_lora, seed=args.seed, eval_every=args.eval_every, save_every=args.save_every,
        out_dir=out, overwrite=args.overwrite, resume=args.resume, progress=not args.no_progress, choices=choices,
        log=args.log, quiet=args.quiet,
    )
    config.validate()
    RunFolder(out, overwrite=args.overwrite, resume=args.resume).check()
    configure_allocator()  # before CUDA starts (joining the group may start it): expandable segments
    with distributed_group() as (rank, world, device), third_party_progress(enabled=not args.no_progress):
        global_batch = args.global_batch_size or default_global_batch(world, args.micro_batch_size)
        if args.micro_batch_size is not None:  # else the plan picks one that divides the global batch
            accumulation_steps(args.micro_batch_size, global_batch, world)
        torch.manual_seed(args.seed)
        model, data, seq_len, source = _model_and_data(args, tokenizer, device)
        n_params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if rank == 0:
            for note in notes:
                echo(f"  {note}", file=sys.stderr)
            lora = (f", LoRA rank {args.lora}: {trainable / 1e6:.2f}M trainable{quantized_text(model)}"
                    f"{frozen_dtype_text(model)}"
                    if args.lora else "")
            log(args, f"memtrain train: {name} ({n_params / 1e6:.2f}M parameters{lora}) on {_where(device)}, {seq_len} "
                      f"tokens x {global_batch} per step, "
                      f"{f'{args.epochs} epoch(s)' if args.epochs else f'{args.max_steps} steps'} on {source} "
                      f"({len(data[0])} training rows, {len(data[1])} eval rows)")
        # Looked up now, not at import: tests wrap memtrain.train.train (which memtrain/__init__ shadows).
        from memtrain.train import train

        result = train(model, data, config, command=command_record(args, parser), tokenizer=tokenizer, device=device)
        if rank == 0:
            _log_result(args, result)
        return EXIT_STOPPED[result.stopped_by] if result.stopped_by else EXIT_OK  # every rank stopped alike


def _check_before_set_up(args: argparse.Namespace, parser: argparse.ArgumentParser,
                         explicit: set[str]) -> tuple[list[str], Any, Choices]:
    """The checks that need no model: (the notes of --resume for the log, --hf-model's tokenizer or None, the
    technique choices of the flags, after --resume has taken back the run's)."""
    if args.resume and not args.out:
        raise ConfigError("--resume needs the run folder to continue. To resolve this error, pass --out DIR.")
    notes = []
    if args.resume and not args.overwrite:
        RunFolder(args.out, resume=True).check()
        notes = resume_flags(args, parser, explicit)
    problems, choices = [], Choices()
    try:
        choices = choices_from_flags(args)
    except ConfigError as e:
        problems += e.problems
    problems += lora_flag_problems(args)
    if args.epochs and "max_steps" in explicit:  # --config or a resume can give both; argparse sees one line
        if args.resume and "epochs" not in explicit:
            args.epochs = None  # --max-steps given to a resumed --epochs run: the new length, as for any run
        else:
            problems.append(f"--epochs {args.epochs} and --max-steps {args.max_steps} both set the run's length. "
                            "To resolve this error, pass one of them.")
    if args.nproc is not None:
        problems += nproc_problems(args.nproc)
    ConfigError.raise_if(problems)
    tokenizer = None
    if args.hf_model:
        with call_site_flags(HF_MODEL_PATH):
            safetensors_files(args.hf_model)  # config.json and safetensors weights, before anything is loaded
            hf_seq_len(hf_folder_config(args.hf_model), args.seq_len, "--hf-model")
        if not args.data:
            raise ConfigError(f"--hf-model {args.hf_model!r} without --data: the built-in corpus is read as bytes, "
                              "not with the model's tokenizer. To resolve this error, pass --data PATH (a .txt "
                              "file, documents split on blank lines, or a .jsonl file with a \"text\" field).")
        with call_site_flags(HF_MODEL_PATH):
            tokenizer = load_tokenizer(args.hf_model, needed_for=f"--data {args.data!r} (and the run's hf/ folder)")
        check_vocabulary(args.hf_model, len(tokenizer))
    if args.data:
        check_data_path(args.data, tokenised=tokenizer is not None)
    if args.eval_data:
        check_data_path(args.eval_data, tokenised=tokenizer is not None, flag="--eval-data")
    return notes + start_up_notes(args, tokenizer), tokenizer, choices


def _model_and_data(args: argparse.Namespace, tokenizer: Any, device: torch.device) -> tuple[Any, Any, int, str]:
    """(the model, built or loaded on the CPU for ``device``, the (training, evaluation) rows, tokens per example,
    where the data comes from). ``train`` places the model as its plan says: the device never holds more of it.

    With --eval-data all of --data (or of the built-in corpus) trains and the file's rows evaluate; without it
    the last 5% is held out. A resume keeps the split of the run it continues (``held_out_fraction``)."""
    held_out = held_out_fraction(args)
    if args.hf_model:
        seq_len = hf_seq_len(hf_folder_config(args.hf_model), args.seq_len, "--hf-model")
        progress = False if args.no_progress else None
        # Tokenised (or read from the cache beside the data) before the model loads: a bad line fails fast.
        with call_site_flags(DATA_PATH), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = (tokenized_rows(args.data, tokenizer, seq_len, val_fraction=held_out, progress=progress)
                    if held_out else (file_rows(args.data, tokenizer, seq_len, progress=progress), None))
        for warning in caught:  # a damaged or unwritable token cache: one line in the command's terms
            echo(f"  note: {in_flag_terms(next(iter(warning.message.args), str(warning.message)), 'train')}", file=sys.stderr)
    # NOTE: not model.to(device): the whole fp32 model would sit on the device before any plan, and a model the
    # plan fits only with bf16 device weights or streamed blocks would run out of memory there.
    model, seq_len = build_language_model(args, device)
    if args.hf_model:
        skipped = sum(rows.skipped_pieces for rows in data if rows is not None)
        source = (f"{args.data} (tokenised with {args.hf_model}'s tokenizer, packed"
                  + (f"; {skipped} pieces of prompts longer than --seq-len {seq_len} skipped: no completion token "
                     "in them" if skipped else "") + ")")
    else:
        with call_site_flags(DATA_PATH):
            tokens = text_file_tokens(args.data) if args.data else stdlib_corpus()
        data = split_windows(tokens, seq_len, val_fraction=held_out) if held_out else (
            _all_rows(ByteWindows(tokens, seq_len), "--data" if args.data else "the built-in corpus", seq_len), None)
        source = args.data or "the Python standard library's source (built-in corpus)"
    if args.eval_data:
        data = (data[0], _eval_rows(args, tokenizer, seq_len))
        source += f", evaluated on {args.eval_data}"
    return model, data, seq_len, source


def _where(device: torch.device) -> str:
    """The training device for the start-up line: a simulated one says what it is."""
    acc = accelerator(device)
    if acc.kind != "simulated":
        return str(device)
    return f"a simulated device of {format_bytes(acc.total_memory)} (MEMTRAIN_SIMULATED_DEVICE; the CPU computes)"


def _all_rows(rows: ByteWindows, what: str, seq_len: int) -> ByteWindows:
    """``rows`` (every window of the training text, none held out), refused when there is none."""
    if len(rows) == 0:
        raise ConfigError(f"{what} makes no example of {seq_len + 1} tokens (an example and its next token). To "
                          "resolve this error, pass a longer file, or a shorter --seq-len.")
    return rows


def _eval_rows(args: argparse.Namespace, tokenizer: Any, seq_len: int) -> Any:
    """--eval-data's rows, read as --data's are (tokenised and packed, or byte windows); all of them held out."""
    with call_site_flags({"path": "--eval-data"}):
        rows = file_rows(args.eval_data, tokenizer, seq_len) if tokenizer is not None \
            else ByteWindows(text_file_tokens(args.eval_data), seq_len)
    if len(rows) == 0:
        raise ConfigError(f"--eval-data {args.eval_data!r} makes no example of {seq_len} tokens. To resolve this "
                          "error, pass a longer file, or a shorter --seq-len.")
    return rows


def _log_result(args: argparse.Namespace, result: TrainResult) -> None:
    """The run's last line: how it stopped, or its loss, speed and memory; with --json the result on stdout."""
    if result.stopped_by and not result.steps:  # stopped inside its first step: no checkpoint to continue from
        log(args, f"stopped by {result.stopped_by} before its first step finished: nothing to resume; start it again "
                  "with the same command and --overwrite")
    elif result.stopped_by:
        log(args, f"stopped by {result.stopped_by} after step {result.steps}; checkpoint in {result.out_dir}; "
                  f"continue with: memtrain train --out {result.out_dir} --resume")
    else:
        eval_text = f" (eval {result.eval_loss:.3f})" if result.eval_loss is not None else ""
        peak = f", peak {format_bytes(result.peak_bytes)}" if result.peak_bytes is not None else ""
        # The first figure is the progress bar's: tokens over the time inside training steps.
        speed = (f"{result.tokens / result.step_seconds:.0f} tokens/s in training steps "
                 f"({result.tokens / result.seconds:.0f} tokens/s wall-clock, with evaluation and checkpoints)"
                 if result.step_seconds else "no step run")
        log(args, f"done: loss {result.final_loss:.3f}{eval_text}, {speed}, saved activations "
                  f"{format_bytes(result.activation_bytes)} per micro-batch, model state "
                  f"{format_bytes(result.model_state_bytes)}{peak}; run folder {result.out_dir}")
    if args.json:
        echo(json.dumps(asdict(result)))
