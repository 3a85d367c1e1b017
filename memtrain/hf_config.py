"""A Hugging Face ``config.json`` checked before a model is built from it (the sizes the user did not write and
transformers would fill from its defaults, the values that cannot make a model) and against the weights loaded
with it (``weights_mismatch_problem``).

A config that leaves out ``hidden_size`` builds at the class's default (4096 for Llama and Mixtral): a model of
billions of parameters nobody asked for, which then trains or fails far from the cause. A Mixtral config routing
each token to more experts than it has fails deep inside ``torch.topk``. Both are a line naming the file and the
key here, with every problem of the file in one ``ConfigError``.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from memtrain.errors import ConfigError

# The keys that set a decoder's size: without them transformers builds the class default's model.
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# A mixture of experts' expert count and top-k, as the architectures spell them (the first the class has is read).
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
# The width of each expert's MLP, where an architecture sizes it apart from intermediate_size.
EXPERT_SIZE_KEYS = ("moe_intermediate_size",)
# Keys that give the attention heads' width explicitly: hidden_size then need not divide into the heads.
_HEAD_WIDTH_MARKS = ("head_dim", "head_size", "kv_channels", "d_kv")

Config = TypeVar("Config")


def checked_config(path: str | os.PathLike[str], build: Callable[[], Config], *, where: str) -> Config:
    """``build()`` (the config of the file at ``path``, read by transformers), after checking the file: one
    ConfigError listing every size the file leaves to a default and every value that cannot make a model.

    Args:
        build: reads the file into a ``PretrainedConfig``, raising ConfigError for what transformers refuses.
        where: how messages name the file (``"--hf-config 'cfg.json'"`` at the CLI, the path in the library).

    Raises:
        ConfigError: see ``config_problems``; transformers' own refusal, together with the sizes left out.
    """
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return build()  # build() names what is wrong with the file
    if not isinstance(fields, dict):
        return build()
    try:
        config = build()
    except ConfigError as e:
        # The values transformers refused are in its message; the sizes it would have filled in are not.
        missing = missing_sizes_problem(fields, where=where)
        raise ConfigError([*([missing] if missing else []), *e.problems]) from None
    missing = missing_sizes_problem(fields, where=where, config=config)
    ConfigError.raise_if([*([missing] if missing else []), *config_problems(fields, config, where=where)])
    return config


def _config_class(fields: Mapping[str, Any]) -> type | None:
    """The ``PretrainedConfig`` class of the file's model_type, or None (transformers then names the problem)."""
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[fields.get("model_type")]
    except (ImportError, KeyError, TypeError):
        return None


def _spellings(config_class: type, key: str) -> set[str]:
    """Every name of ``key`` in the class: itself and its aliases (``attribute_map``: gpt2's n_embd is
    hidden_size; Mixtral's num_experts is num_local_experts), followed both ways."""
    aliases = getattr(config_class, "attribute_map", {}) or {}
    names = {key}
    while True:
        more = {v for k, v in aliases.items() if k in names} | {k for k, v in aliases.items() if v in names}
        if more <= names:
            return names
        names |= more


def _defaults(config_class: type) -> dict[str, Any]:
    """The class's own default of each argument (None where ``__init__`` derives it from others, as Llama's
    num_key_value_heads from num_attention_heads)."""
    try:
        parameters = inspect.signature(config_class.__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def _key(config_class: type, defaults: Mapping[str, Any], fields: Mapping[str, Any], key: str
         ) -> tuple[str | None, str | None]:
    """(the class's name for ``key`` or None where it has none, the name the file writes it under or None)."""
    names = _spellings(config_class, key)
    stored = key if key in defaults else next((n for n in sorted(names) if n in defaults), None)
    written = next((n for n in (stored, *sorted(names)) if n is not None and n in fields), None)
    return stored, written


def _expert_keys(config_class: type, defaults: Mapping[str, Any], fields: Mapping[str, Any]
                 ) -> tuple[tuple[str, str | None], tuple[str, str | None]] | None:
    """((stored, written) of the expert count, of the top-k) for a mixture-of-experts config, else None: one whose
    class default has several experts, or whose file sets an expert count."""
    experts = next((k for k in (_key(config_class, defaults, fields, name) for name in EXPERT_KEYS) if k[0]), None)
    top_k = next((k for k in (_key(config_class, defaults, fields, name) for name in TOP_K_KEYS) if k[0]), None)
    if experts is None or top_k is None:
        return None
    default = defaults.get(experts[0])
    if experts[1] is None and not (_is_int(default) and default > 1):
        return None
    return experts, top_k


def missing_sizes_problem(fields: Mapping[str, Any], *, where: str, config: Any = None) -> str | None:
    """One problem naming the size keys (and for a mixture of experts the expert count and top-k) that the file
    leaves out while its class has a default for them, or None. ``config``: the file as transformers read it,
    whose value of a key differing from the default shows the file set it under a spelling not listed here (an
    old alias its ``__init__`` still reads, as Falcon's n_embed)."""
    config_class = _config_class(fields)
    if config_class is None:
        return None
    defaults = _defaults(config_class)
    keys = [_key(config_class, defaults, fields, key) for key in SIZE_KEYS]
    moe = _expert_keys(config_class, defaults, fields)
    if moe:
        keys += [*moe, *(_key(config_class, defaults, fields, key) for key in EXPERT_SIZE_KEYS)]
    # A default of None is derived from the other sizes (gpt2's n_inner is 4 x n_embd): no size is invented.
    missing = [(stored, defaults[stored]) for stored, written in keys
               if stored is not None and written is None and (defaults[stored] is not None or moe and
                                                             (stored, written) in moe)
               and (config is None or _value(config, stored) in (None, defaults[stored]))]
    if not missing:
        return None
    shown = ", ".join(f"{name} {value}" if value is not None else f"{name} (none: the model would fail)"
                      for name, value in missing)
    return (f"{where} does not set {', '.join(name for name, _ in missing)}: transformers would build the model at "
            f"{config_class.__name__}'s defaults ({shown}), sizes that are not this model's. To resolve this error, "
            "write each of them into the file with the model's value (the config.json saved beside a model's weights "
            "has them all).")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _value(config: Any, name: str | None) -> Any:
    """``config.<name>`` where it is an integer, else None (absent, derived later, per-layer, or not a number)."""
    if name is None:
        return None
    try:
        value = getattr(config, name)
    except Exception:  # noqa: BLE001 - configs refuse some reads (per-layer attributes) with their own errors
        return None
    return value if _is_int(value) else None


def config_problems(fields: Mapping[str, Any], config: Any, *, where: str) -> list[str]:
    """The values of a config file (``fields``, as read into ``config``) that cannot make a model: a size below 1,
    heads that do not divide hidden_size (where no head width is given), key/value heads that do not divide the
    heads, a top-k above the expert count. Each names the file (``where``) and the key."""
    config_class = _config_class(fields) or type(config)
    defaults = _defaults(config_class)

    def read(key: str) -> tuple[str, int | None]:
        stored, written = _key(config_class, defaults, fields, key)
        return written or stored or key, _value(config, stored or key)

    problems = []
    moe = _expert_keys(config_class, defaults, fields)
    sizes = {key: read(key) for key in (*SIZE_KEYS, "num_key_value_heads")}
    if moe:
        sizes["experts"], sizes["top_k"] = read(moe[0][0]), read(moe[1][0])
    for name, value in sizes.values():
        if value is not None and value < 1:
            problems.append(f"{where} sets {name}={value}: a size must be at least 1. To resolve this error, set "
                            f"{name} to the model's value (a positive integer).")
    (hidden_name, hidden), (heads_name, heads) = sizes["hidden_size"], sizes["num_attention_heads"]
    width_given = any(mark in key for key in fields for mark in _HEAD_WIDTH_MARKS)
    head_dim = _value(config, "head_dim")
    if (hidden and heads and hidden > 0 < heads and hidden % heads and not width_given
            and head_dim in (None, hidden // heads)):
        problems.append(f"{where} sets {hidden_name}={hidden} and {heads_name}={heads}: the heads do not divide the "
                        f"hidden size ({hidden} / {heads} is not a whole number), so each head's width is undefined. "
                        f"To resolve this error, set {heads_name} to a divisor of {hidden} (e.g. "
                        f"{_divisor_near(hidden, heads)}){', or set head_dim' if 'head_dim' in defaults else ''}.")
    kv_name, kv = sizes["num_key_value_heads"]
    if kv and heads and kv > 0 < heads and heads % kv:
        given = (f"sets {kv_name}={kv}," if kv_name in fields else
                 f"leaves {kv_name} at {config_class.__name__}'s default, {kv},")
        problems.append(f"{where} {given} which does not divide {heads_name}={heads}: grouped-query attention "
                        "shares each key/value head among a whole number of query heads. To resolve this error, set "
                        f"{kv_name} to a divisor of {heads} (e.g. {_divisor_near(heads, kv)}).")
    if moe:
        (experts_name, experts), (top_k_name, top_k) = sizes["experts"], sizes["top_k"]
        if experts and top_k and top_k > experts >= 1:
            problems.append(f"{where} sets {top_k_name}={top_k}, more than its {experts_name}={experts}: each token "
                            f"would be routed to {top_k} of {experts} experts (torch.topk fails). To resolve this "
                            f"error, set {top_k_name} to at most {experts} (or {experts_name} to at least {top_k}).")
    return problems


def weights_mismatch_problem(config_file: Path, config: Any, mismatched: Sequence[tuple[str, Any, Any]],
                             files: Sequence[Path]) -> str:
    """One line for weights whose shapes are not the ones ``config_file`` builds (transformers'
    ``mismatched_keys``: name, saved shape, built shape): the tensor, the file holding it, both shapes, and the
    config.json key behind the difference where one size of the config explains it."""
    def culprit(item: tuple[str, Any, Any]) -> tuple[str, int, int] | None:
        _, saved, built = item
        if len(saved) != len(built):
            return None
        for have, want in zip(saved, built, strict=True):
            keys = [k for k in _SHAPE_KEYS if _value(config, k) == want and have != want]
            if len(keys) == 1:
                return keys[0], want, have
        return None

    mismatched = sorted(mismatched, key=lambda m: m[0])  # transformers lists them in no fixed order
    name, saved, built = next((m for m in mismatched if culprit(m)), mismatched[0])
    holder = next((f.name for f in files if name in _tensor_names(f)), "the checkpoint")
    more = f" ({len(mismatched) - 1} more tensors differ)" if len(mismatched) > 1 else ""
    found = culprit((name, saved, built))
    why, fix = (f"; {found[0]} is {found[1]} in config.json where the weights have {found[2]}",
                f"set {found[0]} to {found[2]} in {config_file}") if found else \
        ("", f"restore the {config_file} saved with these weights")
    return (f"{config_file} does not match the weights: {name} is {list(saved)} in {holder} but {list(built)} in "
            f"the model config.json builds{more}{why}. To resolve this error, {fix} (or pass the folder these "
            "weights were saved in with their config.json).")


# The config sizes a weight's dimension is made of, for naming the one behind a mismatch.
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "head_dim", "num_key_value_heads",
               "num_attention_heads")


def _tensor_names(file: Path) -> set[str]:
    """The tensor names in a safetensors file (its header only)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return set(f.keys())


def _divisor_near(n: int, wanted: int) -> int:
    """The divisor of ``n`` nearest ``wanted`` (the smaller on a tie)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - wanted), d))


__all__ = ["EXPERT_KEYS", "EXPERT_SIZE_KEYS", "SIZE_KEYS", "TOP_K_KEYS", "checked_config", "config_problems", "missing_sizes_problem",
           "weights_mismatch_problem"]
