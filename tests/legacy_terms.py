"""The library's errors in the command's terms: the library names its arguments (``out_dir=``), the command its
flags (``--out``); one table, ``ARGUMENT_FLAGS`` (``COMMAND_FLAGS`` where one command spells an argument its own
way), translates them."""

from __future__ import annotations

import ast
import contextlib
import re
from typing import Any

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.setting import flags_of

# The flag behind each library argument, for translating the library's errors into the command's terms.
ARGUMENT_FLAGS: dict[str, str] = {
    "out_dir": "--out", "max_steps": "--max-steps", "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size", "lr": "--lr", "warmup_steps": "--warmup-steps", "epochs": "--epochs",
    "lr_schedule": "--lr-schedule", "adam_betas": "--adam-betas", "adam_eps": "--adam-eps",
    "weight_decay": "--weight-decay", "grad_clip": "--grad-clip", "precision": "--precision",
    "checkpointing": "--checkpointing", "seed": "--seed",
    "eval_every": "--eval-every", "save_every": "--save-every", "seq_len": "--seq-len", "device": "--device",
    "world_size": "torchrun --nproc_per_node", "budget": "--budget", "host_budget": "--host-budget",
    "log": "--log",
    "max_grad_norm": "--grad-clip",
}
# The library's advice that names an argument the command has no flag for, in the command's terms.
LIBRARY_PHRASES: dict[str, str] = {
    "or another val_fraction": ("(memtrain train holds out the last 5% of them for validation), or pass "
                                "--eval-data FILE, with which every document of --data trains"),
    "or pass a writable cache_dir": "or copy the data to a writable folder (the cache is written beside it)",
    "or pass device_profile=.": "or pass --gpu with one of the names it knows",
    "(device_profile=None)": "(memtrain plan --gpu NAME)",
}
# Switches: (the flag that makes the argument True, the flag that makes it False); None where the default is.
ARGUMENT_SWITCHES: dict[str, tuple[str | None, str | None]] = {
    "overwrite": ("--overwrite", None), "resume": ("--resume", None), "fsdp": ("--fsdp", None),
    "offload_optimizer": ("--offload-optimizer", "--no-offload-optimizer"),  # train's own argument, not a field
    "compile": ("--compile", None),
    "progress": (None, "--no-progress"),
    "merge_lora": ("--merge-lora", None), "quiet": ("--quiet", None),
}
# Arguments whose value has a flag of its own (``Choices``'s optimizer placement is --[no-]offload-optimizer).
ARGUMENT_VALUES: dict[str, str] = {}
# A setting type's fields declare their flags (memtrain.setting): their terms come from there, as
# "optimizer.state_precision" (a field of Choices.optimizer) and as the bare "state_precision" (the same argument of
# build_optimizer, estimate, CPUOffloadOptimizer).
for _field, _flag in flags_of(Choices):
    ARGUMENT_SWITCHES.update(_flag.argument_terms(_field)[1])
for _field, _flag in flags_of(OptimizerChoice):
    for _name in (f"optimizer.{_field}", _field):
        _values, _switches, _valued = _flag.argument_terms(_name)
        ARGUMENT_FLAGS.update({k: v for k, v in _values.items() if k not in ("name", "kwargs")})
        ARGUMENT_SWITCHES.update(_switches)
        ARGUMENT_VALUES.update(_valued if _name.startswith("optimizer.") else {})
# Flags given once per pair (--optimizer-arg KEY=VALUE): a mapping's value reads as the flag once per key.
PAIR_FLAGS = {flag.name for _, flag in flags_of(OptimizerChoice) if flag.kind == "pairs"}
# Where a command spells an argument its own way: memtrain plan plans --nproc ranks and compares --fsdp / --ddp.
COMMAND_FLAGS: dict[str, dict[str, str]] = {"plan": {"world_size": "--nproc"}}
COMMAND_SWITCHES: dict[str, dict[str, tuple[str | None, str | None]]] = {"plan": {"fsdp": ("--fsdp", "--ddp")}}
_VALUE = r"('[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^{}]*\}|[^\s,;)]+)"
# After "NAME=": no value ("drop optimizer.state_precision=": the argument itself, whatever its value).
_NO_VALUE = r"(?=[\s,;)]|\.(?:\s|$)|$)"


def in_flag_terms(message: str, command: str | None = None, extra: dict[str, str] | None = None) -> str:
    """A library message in the command's terms: ``out_dir='x'`` -> ``--out 'x'``, ``resume=True`` -> ``--resume``,
    ``micro_batch_size`` -> ``--micro-batch-size``, ``optimizer.placement='offload'`` -> ``--offload-optimizer``
    (``world_size=2`` -> ``--nproc 2`` for ``command="plan"``), an argument named without its value
    (``drop optimizer.state_precision=``) -> its flag (``drop --optimizer-state``);
    ``extra`` names what an argument means at one call site (``path=`` is --hf-model's folder or --data's file)."""
    for phrase, words in LIBRARY_PHRASES.items():
        message = message.replace(phrase, words)
    flags = {**ARGUMENT_FLAGS, **COMMAND_FLAGS.get(command or "", {}), **(extra or {})}
    switches = {**ARGUMENT_SWITCHES, **COMMAND_SWITCHES.get(command or "", {})}

    def switch(match: re.Match[str]) -> str:
        on, off = switches[match.group(1)]
        flag = on if match.group(2) == "True" else off
        return flag if flag is not None else f"without {off if match.group(2) == 'True' else on}"

    message = _unvalued(message, flags, switches)
    values = "|".join(map(re.escape, sorted(ARGUMENT_VALUES, key=len, reverse=True)))
    message = re.sub(rf"(?<![\w./-])({values})", lambda match: ARGUMENT_VALUES[match.group(1)], message)
    names = "|".join(map(re.escape, sorted(switches, key=len, reverse=True)))
    message = re.sub(rf"(?<![\w./-])({names})=(True|False)\b", switch, message)
    names = "|".join(map(re.escape, sorted(flags, key=len, reverse=True)))

    def valued(match: re.Match[str]) -> str:
        flag, value = flags[match.group(1)], match.group(2)
        if flag in PAIR_FLAGS and value.startswith("{"):  # {'k': v} -> --optimizer-arg k=v
            with contextlib.suppress(ValueError, SyntaxError):
                pairs = ast.literal_eval(value)
                if isinstance(pairs, dict):
                    return " ".join(f"{flag} {k}={v!r}" for k, v in pairs.items())
        return f"{flag}{value}" if flag.endswith(":") else f"{flag} {value}"

    message = re.sub(rf"(?<![\w./-])({names})={_VALUE}", valued, message)
    bare = [n for n in (*flags, *switches) if "_" in n or "." in n]
    names = "|".join(map(re.escape, sorted(bare, key=len, reverse=True)))

    def named(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in flags:
            return flags[name].removesuffix(" every:")
        on, off = switches[name]
        return on or off or name

    return re.sub(rf"(?<![\w./-])({names})(?![\w=/-])", named, message)


def _unvalued(message: str, flags: dict[str, str], switches: dict[str, tuple[str | None, str | None]]) -> str:
    """``NAME=`` with no value (an argument named whatever its value, e.g. "drop optimizer.state_precision="): a
    valued argument's flag alone (``--optimizer-state``); a switch, or an argument whose values are flags of their
    own, as the message gives it elsewhere (``optimizer.placement='device'``, which the next passes turn into
    ``--no-offload-optimizer``), else its flags."""
    by_values = {key.partition("=")[0] for key in ARGUMENT_VALUES}
    names = "|".join(map(re.escape, sorted({*flags, *switches, *by_values}, key=len, reverse=True)))

    def unvalued(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in flags:
            return flags[name].removesuffix(" every:")
        spellings = ([f"{name}=True", f"{name}=False"] if name in switches else
                     [k for k in ARGUMENT_VALUES if k.startswith(f"{name}=")])
        given = [s for s in spellings if re.search(rf"(?<![\w./-]){re.escape(s)}(?![\w'])", message)]
        if given:
            return given[0]
        if name in switches:
            return switches[name][0] or switches[name][1] or name
        return " or ".join(ARGUMENT_VALUES[s] for s in spellings)

    return re.sub(rf"(?<![\w./-])({names})={_NO_VALUE}", unvalued, message)


@contextlib.contextmanager
def flags_of(extra: dict[str, str]) -> Any:
    """Library errors raised inside, with the arguments of this call site named as their flags."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError([in_flag_terms(p, extra=extra) for p in e.problems]) from None


# What ``path=`` means at the call sites that load --hf-model's folder or read --data's file.
HF_MODEL_PATH, DATA_PATH = {"path": "--hf-model"}, {"path": "--data"}

