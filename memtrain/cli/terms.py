"""The library's errors in the command's terms: the library names its arguments (``out_dir=``), the command its
flags (``--out``). A message keeps the arguments it names as data (``memtrain.message``); each is rendered as its flag:
a setting's field from its declared flag (``memtrain.setting``), another argument from ``ARGUMENT_FLAGS``
(``COMMAND_FLAGS`` where one command spells an argument its own way)."""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.message import Arg, Message, Words, arg, words
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
# Switches: (the flag that makes the argument True, the flag that makes it False); None where the default is.
ARGUMENT_SWITCHES: dict[str, tuple[str | None, str | None]] = {
    "overwrite": ("--overwrite", None), "resume": ("--resume", None), "fsdp": ("--fsdp", None),
    "offload_optimizer": ("--offload-optimizer", "--no-offload-optimizer"),  # train's own argument, not a field
    "compile": ("--compile", None),
    "progress": (None, "--no-progress"),
    "merge_lora": ("--merge-lora", None), "quiet": ("--quiet", None),
}
# Arguments whose values each have a flag of their own, by the value's repr (``Choices``'s optimizer placement:
# 'offload' is --offload-optimizer, 'device' --no-offload-optimizer).
ARGUMENT_VALUES: dict[str, dict[str, str]] = {}
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
# Where a command spells an argument its own way: memtrain plan plans --nproc ranks and compares --fsdp / --ddp;
# memtrain export reads the run folder RUN_DIR (it has no --out).
COMMAND_FLAGS: dict[str, dict[str, str]] = {"plan": {"world_size": "--nproc"}, "export": {"out_dir": "RUN_DIR"}}
COMMAND_SWITCHES: dict[str, dict[str, tuple[str | None, str | None]]] = {"plan": {"fsdp": ("--fsdp", "--ddp")}}


def in_flag_terms(message: str, command: str | None = None, extra: dict[str, str] | None = None) -> str:
    """A library message in the command's terms, each argument it names (``memtrain.message.arg``) as its flag:
    ``out_dir='x'`` -> ``--out 'x'``, ``resume=True`` -> ``--resume``, ``micro_batch_size`` -> ``--micro-batch-size``,
    ``optimizer.placement='offload'`` -> ``--offload-optimizer`` (``world_size=2`` -> ``--nproc 2`` for
    ``command="plan"``), an argument whatever its value (``drop optimizer.state_precision=``) -> its flag (``drop
    --optimizer-state``); ``extra`` names what an argument means at one call site (``path=`` is --hf-model's folder
    or --data's file). A plain string (no argument kept) is returned as it is."""
    flags = {**ARGUMENT_FLAGS, **COMMAND_FLAGS.get(command or "", {}), **(extra or {})}
    switches = {**ARGUMENT_SWITCHES, **COMMAND_SWITCHES.get(command or "", {})}
    message = Message(message)

    def rendered(part: Arg | Words) -> str:
        return part.command if isinstance(part, Words) else _flag_text(part, message, flags, switches)

    return message.render(rendered)


def _flag_text(part: Arg, message: Message, flags: dict[str, str],
               switches: dict[str, tuple[str | None, str | None]]) -> str:
    """One argument as the command line gives it: its flag, with the value where the flag takes one; the library's
    spelling where the command has no flag for it, or no flag for the value given (a switch given 1)."""
    name, value = part.name, part.value
    given = [p.value for p in message.parts if isinstance(p, Arg) and p.name == name and p.value]
    if name in flags:
        flag = flags[name]
        if not value:  # the argument itself
            return flag.removesuffix(" every:")
        if flag in PAIR_FLAGS and value.startswith("{"):  # {'k': v} -> --optimizer-arg k=v
            with contextlib.suppress(ValueError, SyntaxError):
                pairs = ast.literal_eval(value)
                if isinstance(pairs, dict):
                    return " ".join(f"{flag} {k}={v!r}" for k, v in pairs.items())
        return f"{flag}{value}" if flag.endswith(":") else f"{flag} {value}"
    if name in switches:
        on, off = switches[name]
        if value == "" and given:  # the switch whatever its value: as the message gives it elsewhere
            value = given[0]
        if value == "True":
            return on if on is not None else f"without {off}"
        if value == "False":
            return off if off is not None else f"without {on}"
        return on or off or name if not value else str(part)
    if name in ARGUMENT_VALUES:
        valued = ARGUMENT_VALUES[name]
        if value == "" and given:
            value = given[0]
        if value in valued:
            return valued[value]
        # Whatever value: each flag once ("--offload-optimizer bf16-weights" is --offload-optimizer's)
        return " or ".join(dict.fromkeys(text.split(" ")[0] for text in valued.values())) if not value else str(part)
    return str(part)


@contextlib.contextmanager
def call_site_flags(extra: dict[str, str]) -> Iterator[None]:
    """Library errors raised inside, with the arguments of this call site (``extra``: e.g. ``path`` is --hf-model's
    folder) as their flags; the other arguments stay kept, for the command to name."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError([_at_call_site(p, extra) for p in e.problems]) from None


def _at_call_site(message: Message, extra: dict[str, str]) -> str:
    """``message``'s marked text with the arguments ``extra`` names worded both ways (the library's, the flag)."""
    def part_text(part: str | Arg | Words) -> str:
        if isinstance(part, Words):
            return words(part.library, part.command)
        if isinstance(part, Arg) and part.name in extra:
            return words(str(part), _flag_text(part, message, extra, {}))
        return arg(part.name, text=part.value) if isinstance(part, Arg) else part

    return "".join(map(part_text, message.parts))


# What ``path=`` means at the call sites that load --hf-model's folder or read --data's file.
HF_MODEL_PATH, DATA_PATH = {"path": "--hf-model"}, {"path": "--data"}
# apply_lora's arguments, at the call site that takes them from --lora, --lora-alpha, --lora-dropout, --lora-targets.
LORA_FLAGS = {"r": "--lora", "alpha": "--lora-alpha", "dropout": "--lora-dropout", "target_modules": "--lora-targets"}

