"""``memtrain export RUN_DIR``: a run's ``hf/`` and ``sample.txt`` written again from its weights, with no training;
and ``memtrain train --resume`` of a run that finished training but not its exports (they failed or were
interrupted), which writes them the same way."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch

from memtrain.cli.console import EXIT_OK, echo, log, third_party_progress
from memtrain.cli.flags import build_parser, subparser
from memtrain.cli.terms import HF_MODEL_PATH, call_site_flags
from memtrain.cli.workloads import build_language_model
from memtrain.errors import ConfigError
from memtrain.hf import load_tokenizer
from memtrain.run import RunFolder, read_run_config
from memtrain.run.export import (
    EXPORT_DTYPES,
    export_results,
    load_weights,
    missing_exports,
    newest_checkpoint_step,
    run_weights,
)


def cmd_export(args: argparse.Namespace) -> int:
    """memtrain export RUN_DIR: the run's model rebuilt from its config.json, its weights loaded, exports written."""
    written, source = export_run(args.run_dir, dtype=EXPORT_DTYPES[args.export_dtype])
    log(args, f"memtrain export: wrote {', '.join(written)} in {args.run_dir} from {source}")
    if args.json:
        echo(json.dumps({"run_dir": str(args.run_dir), "written": written, "weights": source}))
    return EXIT_OK


def export_run(run_dir: str | os.PathLike[str], *,
               dtype: torch.dtype | Literal["auto"] = "auto") -> tuple[list[str], str]:
    """Writes ``hf/`` and ``sample.txt`` of a ``memtrain train`` run from its ``model.safetensors`` (else its newest
    intact checkpoint), the model rebuilt from the flags its ``config.json`` records. The folder is locked meanwhile
    (not while a run uses it). Returns (the names written, where the weights came from).

    Raises:
        ConfigError: not a run folder of memtrain train, no weights, a model folder that moved, nothing to export.
    """
    folder = Path(run_dir)
    with RunFolder(folder, export=True):
        doc = read_run_config(folder)
        command, train = doc.get("command"), doc.get("train") or {}
        if not isinstance(command, dict):
            raise ConfigError(f"{str(folder)!r}: the run was started from Python (train()), not by memtrain train, "
                              "so its model flags are not recorded. To resolve this error, load model.safetensors "
                              "into the model in Python and call memtrain.hf.save_hf(model, DIR, tokenizer=...).")
        args = _train_args(command)
        if dtype != "auto" and not (args.hf_model or args.hf_config):
            raise ConfigError(f"--export-dtype {_dtype_name(dtype)}: the run's model is memtrain's GPT "
                              f"(--model {args.model}), which has no hf/ folder whose weights it would set; its "
                              "weights are model.safetensors, as trained, and sample.txt holds text. To resolve "
                              "this error, drop --export-dtype (it applies to --hf-model and --hf-config runs).")
        state, source, damage = run_weights(folder)
        model, seq_len = build_language_model(args)
        tokenizer = None
        if args.hf_model:
            with call_site_flags(HF_MODEL_PATH):
                tokenizer = load_tokenizer(args.hf_model, needed_for="the run's hf/ folder and sample.txt")
        load_weights(model, state, str(folder / source) if source == "model.safetensors" else f"{source} of {folder}")
        written = export_results(folder, model, None, tokenizer, seq_len=seq_len,
                                 sample_bytes=int(train.get("sample_bytes") or 0), seed=int(train.get("seed") or 0),
                                 merge=bool(train.get("merge_lora")), writer=True, dtype=dtype)
    if not written:
        raise ConfigError(f"{str(folder)!r}: the run's model has nothing to export (no Hugging Face model for hf/, "
                          "no tokenizer or byte-level vocabulary for sample.txt, or sample_bytes=0). To resolve "
                          "this error, use its model.safetensors, which is the run's result.")
    if damage is not None:  # said with what was written, in its one line
        source = f"{source} instead, because {damage} (that file is left as it is)"
    return written, source


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in EXPORT_DTYPES.items() if value == dtype)


def export_finished_run(args: argparse.Namespace, explicit: set[str]) -> bool:
    """--resume of a run that finished its steps but lacks hf/ or sample.txt (the export failed or was
    interrupted): writes them from model.safetensors (rank 0), trains nothing, and returns True. False when the run
    has steps left (or a larger --max-steps given now) or lacks no export: the resume goes on as usual."""
    folder = Path(args.out)
    if not (folder / "model.safetensors").is_file():
        return False
    try:
        doc = read_run_config(folder)
    except ConfigError:
        return False
    command, train = doc.get("command"), doc.get("train") or {}
    if not isinstance(command, dict) or not isinstance(train.get("max_steps"), int):
        return False
    max_steps = args.max_steps if "max_steps" in explicit else train["max_steps"]
    step = newest_checkpoint_step(folder)
    reached = step if step is not None else train["max_steps"]  # no checkpoint left: the steps it was run for
    missing = missing_exports(folder, command, train)
    if reached < max_steps or not missing:
        return False
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun one rank writes; the others have nothing to do
        with third_party_progress(enabled=not args.no_progress):  # transformers' loading and writing bars
            written, source = export_run(folder)
        log(args, f"--resume: the run in {folder} finished training at step {reached} without writing "
                  f"{' and '.join(missing)}: wrote {', '.join(written)} from {source}; no step trained")
    return True


def _train_args(command: dict[str, Any]) -> argparse.Namespace:
    """The memtrain train flags a run recorded, over the parser's defaults (options added since default)."""
    args = subparser(build_parser(), "train").parse_args([])
    for dest, value in command.items():
        setattr(args, dest, tuple(value) if isinstance(value, list) else value)
    return args
