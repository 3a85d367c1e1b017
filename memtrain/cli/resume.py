"""``memtrain train --resume``: the options a run records in its config.json, and the flags a resume takes back
from it (model and data flags given again must be the same)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memtrain.choices import default_global_batch
from memtrain.cli.flags import subparser
from memtrain.cli.workloads import hf_folder_config, hf_seq_len
from memtrain.errors import ConfigError
from memtrain.estimate import hf_config_from_file
from memtrain.models import GPT_PRESETS
from memtrain.run import read_run_config

# The options of memtrain train that config.json records (the others say how to run, not what: --json, --out,
# --resume, --overwrite, --config); and those that define the model and the data, which a resume must keep.
_NOT_RECORDED = frozenset({"help", "config", "out", "resume", "overwrite", "json", "command"})
_MODEL_FLAGS = ("model", "hf_model", "lora", "lora_alpha", "lora_dropout", "lora_targets", "seq_len",
                "quantize_base")  # refused
# here when changed; a new --data or --hf-config path is let through: train() compares the contents (a SHA-256 of the token stream, the parameters' names and
# shapes), so a moved file still resumes and a changed one is refused
_PATH_FLAGS = ("data", "eval_data", "hf_config", "hf_model")  # recorded absolute: a resume may run from another folder
# The share of --data (or of the built-in corpus) held out for evaluation, recorded in config.json under this key:
# none with --eval-data (a held-out file of its own, so all of --data trains), else the last 5%. A resume reads it
# back so that it trains on the rows the run it continues trained on, whatever --eval-data says now; runs recorded
# before the key held out 5% even with --eval-data.
HELD_OUT_KEY = "held_out_of_data"
HELD_OUT_WITHOUT_EVAL_DATA = 0.05


def held_out_fraction(args: argparse.Namespace) -> float:
    """The share of the training data held out for evaluation: the run's recorded one on a resume, else none
    with --eval-data and 5% without."""
    recorded = getattr(args, HELD_OUT_KEY, None)
    if recorded is not None and (recorded or args.eval_data):  # nothing held out needs a file to evaluate on
        return float(recorded)
    return 0.0 if args.eval_data else HELD_OUT_WITHOUT_EVAL_DATA


def command_record(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The train options as JSON values, paths absolute (a resume may run from another folder)."""
    record = {}
    for action in subparser(parser, "train")._actions:  # noqa: SLF001
        if action.dest in _NOT_RECORDED:
            continue
        value = getattr(args, action.dest)
        if action.dest in _PATH_FLAGS and value:
            value = str(Path(value).absolute())
        record[action.dest] = list(value) if isinstance(value, tuple) else value
    record[HELD_OUT_KEY] = held_out_fraction(args)
    return record


def resume_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, explicit: set[str]) -> list[str]:
    """With --resume: every option not given now takes the value the run started with (from its config.json);
    model and data options given now must equal those. Returns notes for the log.

    The other options given now go to train(), which refuses a changed run-defining one (e.g. --lr, other data
    under a new --data path) and applies the others (e.g. --max-steps) with a logged line.
    """
    try:
        saved = read_run_config(args.out).get("command")
    except ConfigError as e:
        return [f"--resume: {e}: using the flags given now (the checkpoint checks the run-defining ones)"]
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: the run in {args.out!r} was started from Python (train()), not by memtrain "
                          "train, so its model and data flags are not recorded. To resolve this error, resume it "
                          "from Python with TrainConfig(resume=True), or pass its flags to a new run.")
    now = command_record(args, parser)
    problems = []
    for dest in _MODEL_FLAGS:
        if dest in explicit and dest in saved and now[dest] != saved[dest]:
            used, how = saved[dest], ""
            if dest == "seq_len" and used is None:  # the run took the model's default: compare with that
                used, how = _default_seq_len(saved), " (the model's default, no --seq-len given)"
                if used == now[dest]:
                    continue
            flag = "--" + dest.replace("_", "-")
            shown = "not given" if used is None else repr(used)
            problems.append(f"--resume: {flag} {now[dest]!r} now but {shown} in the run being resumed{how}: "
                            f"another model would not continue it. To resolve this error, drop {flag} (--resume "
                            "reads it from the run's config.json), or start a new run in another --out.")
    ConfigError.raise_if(problems)
    # Runs recorded before the planner: checkpointing as [mode, K], and a --no-chunked-loss switch.
    if isinstance(saved.get("checkpointing"), list):
        mode, every = saved["checkpointing"]
        saved["checkpointing"] = f"every:{every}" if mode == "every" else mode
    if saved.get("no_chunked_loss") is True and "chunked_loss" not in saved:
        saved["chunked_loss"] = False
    for dest, value in saved.items():
        if dest not in explicit and dest in now:
            setattr(args, dest, tuple(value) if isinstance(value, list) else value)
    if HELD_OUT_KEY not in saved:  # recorded before --eval-data let all of --data train: 5% was held out
        setattr(args, HELD_OUT_KEY, HELD_OUT_WITHOUT_EVAL_DATA)
    notes = [f"--resume: the flags of the run in {args.out} (config.json)"
             + (f", with {', '.join('--' + d.replace('_', '-') for d in sorted(explicit & set(now)))} given now"
                if explicit & set(now) else "")]
    ranks = saved.get("nproc")
    if args.global_batch_size is None and isinstance(ranks, int) and ranks != args.nproc:
        # The run's default global batch was its ranks' share each: on other ranks it stays the run's (its steps'
        # examples), which the checkpoint reshards onto them.
        args.global_batch_size = default_global_batch(ranks, saved.get("micro_batch_size"))
        notes.append(f"--resume: --global-batch-size {args.global_batch_size}, the run's (its default over "
                     f"its {ranks} ranks), on {args.nproc} now")
    return notes




def _default_seq_len(saved: dict[str, Any]) -> int | None:
    """The sequence length a run started without --seq-len used: its model's default (None if unknown now)."""
    try:
        if saved.get("hf_model"):
            return hf_seq_len(hf_folder_config(saved["hf_model"]), None, "--hf-model")
        if saved.get("hf_config"):
            return hf_seq_len(hf_config_from_file(saved["hf_config"]), None, "--hf-config")
        preset = GPT_PRESETS.get(saved.get("model"))
        return preset.seq_len if preset is not None else None
    except ConfigError:  # the model's files moved or changed: train() compares what it can
        return None
