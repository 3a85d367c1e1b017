"""Hugging Face models in memtrain: local pretrained folders in, LoRA adapters, ``from_pretrained`` folders out.

Fine-tuning a pretrained model is the common case on a GPU that is too small. This module is the bridge:

- ``load_pretrained(DIR)`` / ``load_tokenizer(DIR)``: a local folder (``config.json``, ``*.safetensors``, a fast
  tokenizer), never the network, never a pickle (``.bin`` checkpoints are refused: unpickling runs code).
- ``apply_lora(model, r)``: PEFT LoRA adapters of rank ``r`` on a frozen base; ``merge_lora(model)`` folds them in.
- QLoRA: ``memtrain.quantize.quantize_base(model, "nf4", compute_dtype=torch.bfloat16)`` before ``apply_lora``
  stores the frozen linear weights in 4-bit NF4 (bitsandbytes); ``save_hf`` then writes the adapters, which load onto
  the unquantised base.
- ``save_hf(model, DIR, tokenizer=...)``: a folder that ``AutoModelForCausalLM.from_pretrained`` (or, for a LoRA
  model, ``PeftModel.from_pretrained``) loads to the same logits, written atomically.
- ``prepare_model`` and ``MemtrainTrainer``: memtrain's checkpointing, chunked loss, activation offload and
  ``CPUOffloadOptimizer`` inside ``transformers.Trainer``.

transformers and peft are imported when first needed: ``pip install 'memtrain[hf]'`` / ``'memtrain[lora]'``.

Fine-tuning a local model with the Hugging Face Trainer (tested in tests/test_hf.py: the weights equal
memtrain's own loop's)::

    from transformers import TrainingArguments
    from memtrain.data import hf_collate, tokenized_rows
    from memtrain.choices import Choices, OptimizerChoice
    from memtrain.hf import MemtrainTrainer, apply_lora, load_pretrained, load_tokenizer, save_hf

    model = load_pretrained("my-llama")                      # config.json + *.safetensors, fp32 weights
    rows, _ = tokenized_rows("docs.jsonl", load_tokenizer("my-llama"), seq_len=2048)  # packed, cached
    model = apply_lora(model, 8)                             # optional: adapters on a frozen base
    args = TrainingArguments("out", bf16=True, max_steps=1000, max_grad_norm=1.0, learning_rate=2e-4)
    memory = Choices(checkpointing="all", chunked_loss=True, optimizer=OptimizerChoice(placement="offload"))
    trainer = MemtrainTrainer(model, args, memory=memory, train_dataset=rows, data_collator=hf_collate)
    trainer.train()
    save_hf(trainer.model, "out/hf", tokenizer="my-llama")   # adapters; save_hf(merge_lora(...)) for weights
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from memtrain.errors import ConfigError, describe_exception
from memtrain.files import replace_folder
from memtrain.hf_config import checked_config, weights_mismatch_problem
from memtrain.hf_trainer import (
    HF_DEFAULT_CHOICES,
    Prepared,
    build_trainer_class,
    prepare_model,
    trainer_choices,
    trainer_problems,
)
from memtrain.message import arg
from memtrain.quantize import bitsandbytes_quiet
from memtrain.unwrap import unwrap_model

# Checkpoint formats that are pickles: loading one runs whatever code it holds.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face models need the transformers package, which is not installed. To resolve "
                          "this error, run: pip install 'memtrain[hf]'") from None
    return transformers


def _peft() -> Any:
    try:
        with bitsandbytes_quiet():  # peft imports it where it is installed
            import peft
    except ImportError:
        raise ConfigError("LoRA needs the peft package, which is not installed. To resolve this error, run: pip "
                          "install 'memtrain[lora]'") from None
    return peft


# -- loading ------------------------------------------------------------------------------------------------------
def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a local pretrained folder, after checking it: ``config.json`` and safetensors weights
    (one file, several, or a sharded index whose shards are all present).

    Raises:
        ConfigError: a missing folder, no ``config.json``, a pickle-only checkpoint, missing shards, no weights,
            a weights file cut short (its header does not cover it).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{arg('path', str(path))}: no such folder. To resolve this error, pass a local folder "
                          "holding config.json and *.safetensors weights (e.g. one written by save_pretrained).")
    problems = []
    if not (folder / "config.json").is_file():
        problems.append(f"{folder} holds no config.json, so the architecture is unknown. To resolve this error, "
                        "pass the folder save_pretrained wrote (config.json beside the weights).")
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e}). To resolve this "
                              "error, write it again with save_pretrained.") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            problems.append(f"{index} lists {len(shards)} shards, {len(missing)} of them missing: "
                            f"{', '.join(missing[:5])}. To resolve this error, copy every shard into {folder}.")
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    for file in files:
        if file.is_file() and (damage := _safetensors_damage(file)):
            problems.append(f"{file} is not a whole safetensors file ({damage}): a download or copy cut short? "
                            "To resolve this error, download or copy it again.")
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            problems.append(f"{folder} holds only pickled weights ({', '.join(pickles[:3])}); memtrain never "
                            "unpickles a checkpoint (loading a pickle runs the code it holds). To resolve this "
                            "error, convert them once where you trust the file: AutoModelForCausalLM."
                            "from_pretrained(DIR).save_pretrained(DIR) writes model.safetensors.")
        else:
            problems.append(f"{folder} holds no weights (*.safetensors). To resolve this error, pass a folder "
                            "written by save_pretrained, or build a randomly initialised model from config.json "
                            "alone (AutoModelForCausalLM.from_config).")
    ConfigError.raise_if(problems)
    return files


def _safetensors_damage(file: Path) -> str | None:
    """What is wrong with a safetensors file's header (which covers the whole file: a truncated file fails it),
    or None; only the header is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            return None
    except (SafetensorError, OSError) as e:
        return str(e)


def load_pretrained(path: str | os.PathLike[str], *, dtype: torch.dtype | Literal["auto"] = torch.float32,
                    attn_implementation: str = "sdpa") -> nn.Module:
    """Loads a causal LM from a local folder: safetensors only, no network, no remote code.

    Args:
        path: a folder holding ``config.json`` and ``*.safetensors`` (or a sharded ``model.safetensors.index.json``).
        dtype: the parameters' dtype (fp32 by default: master weights for mixed precision); ``"auto"`` keeps the
            checkpoint's.
        attn_implementation: ``"sdpa"`` (torch's fused attention; what memtrain's estimate models) or ``"eager"``.

    Returns:
        The ``PreTrainedModel`` in training mode with ``use_cache=False`` (a KV cache is only for generation).

    Raises:
        ConfigError: see ``safetensors_files``; a checkpoint that leaves some of the model's weights unset.
    """
    files = safetensors_files(path)
    transformers = _transformers()
    if dtype != "auto" and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype={dtype!r} must be a torch.dtype (e.g. torch.bfloat16) or 'auto'. To resolve "
                          "this error, pass dtype=torch.float32 (the default) or dtype='auto'.")
    config_file = Path(path) / "config.json"
    config = checked_config(config_file, lambda: _pretrained_config(transformers, path), where=str(config_file))
    # transformers 4.56 renamed torch_dtype to dtype.
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    dtype_key = "dtype" if version >= (4, 56) else "torch_dtype"
    report: list[logging.LogRecord] = []
    try:
        # Mismatched sizes are loaded as random weights and listed, so that the error below names the tensor and
        # both shapes (transformers' own error only points at its report).
        with _load_report_kept(report):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, use_safetensors=True, trust_remote_code=False,
                attn_implementation=attn_implementation, output_loading_info=True, ignore_mismatched_sizes=True,
                **{dtype_key: dtype})
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        _emit(report)  # its details (e.g. a weight conversion that failed) are the cause
        raise ConfigError(f"transformers could not load {path}: {describe_exception(e)}. "
                          "To resolve this error, check that config.json names a causal LM architecture that "
                          f"transformers {transformers.__version__} knows and that the weights match it.") from None
    mismatched = list(info.get("mismatched_keys") or ())
    if mismatched:
        raise ConfigError(weights_mismatch_problem(config_file, config, mismatched, files))
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(f"{path}: the checkpoint leaves {len(missing)} of the model's weights unset "
                          f"({', '.join(missing[:5])}); they would train from random values. To resolve this "
                          "error, pass a folder whose weights match its config.json.")
    if info.get("unexpected_keys"):
        keys = sorted(info["unexpected_keys"])
        warnings.warn(f"{path}: {len(keys)} weights in the checkpoint are not used by the model "
                      f"({', '.join(keys[:5])}).", stacklevel=2)
    model.config.use_cache = False
    return model.train()


def _pretrained_config(transformers: Any, path: str | os.PathLike[str]) -> Any:
    """The folder's config.json read by transformers (no network, no remote code)."""
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"transformers could not read {Path(path) / 'config.json'}: {describe_exception(e)}. "
                          "To resolve this error, fix the field it names (or write the file again with "
                          "save_pretrained).") from None


@contextlib.contextmanager
def _load_report_kept(kept: list[logging.LogRecord]) -> Any:
    """transformers' "LOAD REPORT" table (missing, unexpected, mismatched weights) kept in ``kept`` instead of
    logged: ``load_pretrained`` says each of those in its own words, and logs the table (``_emit``) only where
    transformers' error needs it."""
    logger = logging.getLogger("transformers.modeling_utils")

    def keep(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            kept.append(record)
            return False
        return True

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _emit(records: list[logging.LogRecord]) -> None:
    for record in records:
        logging.getLogger(record.name).handle(record)


def load_tokenizer(path: str | os.PathLike[str], *, needed_for: str = "tokenising the data") -> Any:
    """The fast tokenizer saved in a model folder (``tokenizer.json``), loaded without the network.

    Args:
        needed_for: what needs it, for the error message (e.g. ``"tokenize_file('docs.jsonl')"``).

    Raises:
        ConfigError: the folder holds no tokenizer, or only a slow (Python) one.
    """
    folder = Path(path)
    if not folder.is_dir() or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{folder} holds no tokenizer ({' / '.join(TOKENIZER_FILES)}), which {needed_for} "
                          "needs. To resolve this error, save the model's tokenizer into the folder "
                          "(tokenizer.save_pretrained(DIR)), or train on the built-in GPT, which reads bytes.")
    transformers = _transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                               trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"transformers could not load the tokenizer in {folder}: {describe_exception(e)}. "
                          "To resolve this error, save it again with "
                          "tokenizer.save_pretrained(DIR).") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer in {folder} is a slow (Python) {type(tokenizer).__name__}; memtrain "
                          "tokenises in batches with a fast one. To resolve this error, save a tokenizer.json "
                          "(AutoTokenizer.from_pretrained(DIR, use_fast=True).save_pretrained(DIR)).")
    return tokenizer


# -- LoRA ----------------------------------------------------------------------------------------------------------
def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (LoRA adapters on a frozen base), inside compile/DDP wrappers too."""
    model = unwrap_model(model)
    try:
        with bitsandbytes_quiet():  # peft imports it where it is installed
            import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def lora_targets(model: nn.Module) -> list[str]:
    """The default LoRA targets: every ``nn.Linear`` of the model but its output head (attention and MLP
    projections; the head stays frozen, as in PEFT's ``"all-linear"``)."""
    from memtrain.quantize import quantized_layers  # the layers a 4-bit base quantises: the same ones

    return quantized_layers(model)


def apply_lora(model: nn.Module, r: int | Any = 8, *, alpha: float | None = None, dropout: float = 0.0,
               target_modules: Sequence[str] | None = None) -> nn.Module:
    """Adds LoRA adapters of rank ``r`` and freezes everything else: the gradients and optimizer state of
    ``r * (in + out)`` numbers per adapted layer instead of its whole weight, at a lower capacity.

    Args:
        model: a Hugging Face causal LM, or any module with linear layers (memtrain's GPT included).
        r: the rank, or a ready ``peft.LoraConfig`` (the other arguments must then be left out).
        alpha: LoRA's scaling numerator (the update is scaled by ``alpha / r``); None keeps PEFT's default.
        dropout: dropout on the adapters' input.
        target_modules: the module names to adapt; default ``lora_targets(model)``.

    Returns:
        The ``peft.PeftModel``; only adapter weights require grad. Its ``state_dict`` names differ from the
        base's (``base_model.model...``): save it with ``save_hf``.

    Raises:
        ConfigError: a bad rank, a model that already has adapters, or no linear layer to adapt.
    """
    peft = _peft()
    if isinstance(r, peft.LoraConfig):
        config = r
        if alpha is not None or dropout != 0.0 or target_modules is not None:
            raise ConfigError("apply_lora got a LoraConfig and alpha/dropout/target_modules: the config already "
                              "holds them. To resolve this error, set them on the LoraConfig only.")
    else:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"{arg('r', r)}: the LoRA rank must be an integer >= 1. To resolve this error, pass "
                              f"e.g. {arg('r', 8)}.")
        config = None
    if is_lora(model):
        raise ConfigError(f"{type(model).__name__} already has LoRA adapters. To resolve this error, apply LoRA "
                          "once (merge_lora(model) first to stack a second set on merged weights).")
    if config is None:
        _check_lora_options(model, alpha, dropout, target_modules)
    targets = list(target_modules) if target_modules is not None else lora_targets(model)
    if config is None and not targets:
        raise ConfigError(f"{arg('r', r)}: {type(model).__name__} has no linear layer to adapt (LoRA adds low-rank "
                          "updates to nn.Linear weights; the output head is left out). To resolve this error, "
                          f"train the whole model without LoRA, or pass {arg('target_modules')} naming its layers.")
    if config is None:
        config = peft.LoraConfig(r=r, target_modules=targets, lora_dropout=dropout,
                                 task_type="CAUSAL_LM" if _is_hf_causal_lm(model) else None,
                                 **({} if alpha is None else {"lora_alpha": alpha}))
    try:
        with warnings.catch_warnings():
            # peft asks transformers 5.2x's PreTrainedModel by its deprecated name: nothing a user changes
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            lora = peft.get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"peft could not add adapters to {type(model).__name__}: {e}. To resolve this error, "
                          f"pass {arg('target_modules')} naming its nn.Linear layers.") from None
    if getattr(getattr(model, "config", None), "use_cache", None):
        model.config.use_cache = False
    return lora


def _check_lora_options(model: nn.Module, alpha: float | None, dropout: float,
                        target_modules: Sequence[str] | None) -> None:
    """One ConfigError for every bad LoRA option: alpha > 0, 0 <= dropout < 1, and each target naming a module
    of ``model`` as PEFT matches it (the full name, or its end after a dot)."""
    problems = []
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0):
        problems.append(f"{arg('alpha', alpha)}: LoRA's scaling numerator must be a number > 0. To resolve this "
                        f"error, pass e.g. {arg('alpha', 16)} (the update is scaled by alpha / r).")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"{arg('dropout', dropout)}: the adapters' input dropout must be in [0, 1). To resolve this "
                        f"error, pass e.g. {arg('dropout', 0.05)}.")
    if target_modules is not None:
        if isinstance(target_modules, str):
            target_modules = [target_modules]
        names = [name for name, _ in model.named_modules() if name]
        missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if missing or not target_modules:
            linear = sorted({name.rsplit(".", 1)[-1] for name in lora_targets(model)})
            problems.append(f"{arg('target_modules', list(target_modules))}: {type(model).__name__} has no module "
                            f"named {', '.join(map(repr, missing)) or 'at all'}; its linear layers are named "
                            f"{', '.join(linear) or '(none)'}. To resolve this error, pass some of those names.")
    ConfigError.raise_if(problems)


def merge_lora(model: nn.Module) -> nn.Module:
    """Folds the LoRA adapters into the base weights and returns the base model (in place: the PEFT wrapper is
    spent). Its forward is then one matmul per layer again, and ``save_hf`` writes a plain checkpoint.

    Raises:
        ConfigError: the model has no LoRA adapters (no ``apply_lora`` before).
    """
    inner = unwrap_model(model)
    if not is_lora(inner):
        raise ConfigError(f"merge_lora: {type(inner).__name__} has no LoRA adapters to merge. To resolve this "
                          "error, add adapters with apply_lora(model, r=8) before training, or do not merge.")
    return inner.merge_and_unload()


def _is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and hasattr(model, "prepare_inputs_for_generation")


# -- export --------------------------------------------------------------------------------------------------------
def is_hf_model(model: nn.Module) -> bool:
    """Whether ``save_hf`` can write ``model``: a transformers ``PreTrainedModel`` or a PEFT model (inside
    compile/DDP wrappers too), whatever is installed."""
    return callable(getattr(unwrap_model(model), "save_pretrained", None))


def save_hf(model: nn.Module, directory: str | os.PathLike[str], *, tokenizer: Any = None,
            dtype: torch.dtype | Literal["auto"] | None = "auto",
            state: dict[str, torch.Tensor] | None = None) -> Path:
    """Writes a Hugging Face folder: the model's ``config.json`` and ``model.safetensors`` (its own parameter
    names; sharded as ``save_pretrained`` shards), or for a LoRA model ``adapter_config.json`` and
    ``adapter_model.safetensors`` (the adapters only); plus the tokenizer's files.

    ``AutoModelForCausalLM.from_pretrained(directory)`` (``PeftModel.from_pretrained(base, directory)`` for
    adapters) gives the same logits. memtrain's patches (checkpointing, the chunked loss) live on module
    instances, not in the state dict, so a patched model saves as the plain one. The folder is assembled under a
    temporary name beside ``directory`` and renamed into place: a crash leaves the old folder or the new one.

    The folder is the model's source folder (its ``config._name_or_path``) changed only by training:
    ``config.json``'s ``use_cache`` is the source's again (``load_pretrained`` turns it off for training), the
    weights are in the source checkpoint's dtype, ``adapter_config.json`` names the base model by its absolute
    path, and the tokenizer files are the source's unless the tokenizer itself changed (the keys a local load
    adds, ``local_files_only`` and ``is_local``, are left out).

    Args:
        model: a ``PreTrainedModel`` or ``PeftModel`` (inside compile/DDP wrappers too).
        directory: the folder to write (replaced if it exists).
        tokenizer: a tokenizer, or a folder to copy its tokenizer files from; None writes none.
        dtype: the weights' dtype in the folder: ``"auto"`` the source checkpoint's (a bf16 checkpoint trained
            with fp32 master weights is written in bf16, half the bytes; LoRA adapters stay as trained), None the
            parameters' own, or a floating torch dtype (adapters too).
        state: the weights to write, by name, instead of ``model.state_dict()``: the full state dict gathered on
            rank 0 for an FSDP2-sharded ``model``, whose own parameters are shards.

    Returns:
        The folder written.

    Raises:
        ConfigError: a model Hugging Face cannot save (not a PreTrainedModel/PeftModel, or sharded by FSDP2 with
            no ``state``), or a dtype that is not a floating torch dtype.
    """
    model = unwrap_model(model)
    if not callable(getattr(model, "save_pretrained", None)):
        raise ConfigError(f"save_hf: a {type(model).__name__} has no save_pretrained, so no Hugging Face folder can "
                          "be written for it. To resolve this error, pass a transformers PreTrainedModel or a PEFT "
                          "model (memtrain's own models are saved as model.safetensors).")
    if state is None and any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ConfigError("save_hf: the model's parameters are sharded (FSDP2 DTensors). To resolve this error, "
                          "gather a full state dict on rank 0 first (torch.distributed.checkpoint."
                          "state_dict.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))) "
                          "and pass it as state=.")
    if dtype not in ("auto", None) and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"save_hf: dtype={dtype!r} is not a floating torch dtype. To resolve this error, pass "
                          "dtype='auto' (the source checkpoint's), None (the parameters' own) or e.g. torch.bfloat16.")
    source = _source_config(model)
    if dtype == "auto":
        dtype = None if is_lora(model) else _config_dtype(source)
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        if dtype is not None:
            state = _cast_state(model.state_dict() if state is None else state, dtype)
        model.save_pretrained(staging, safe_serialization=True, **({} if state is None else {"state_dict": state}))
        _restore_source_fields(staging, source, dtype)
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer, needed_for="the hf/ folder")
        if tokenizer is not None:
            _save_tokenizer(tokenizer, staging)
        replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


# Keys a local AutoTokenizer.from_pretrained adds to the tokenizer's init kwargs (and so to a saved
# tokenizer_config.json): how it was loaded, not what it is.
_TOKENIZER_LOAD_KEYS = ("local_files_only", "is_local")
# A tokenizer's files besides TOKENIZER_FILES, kept as the source folder had them.
_TOKENIZER_EXTRA_FILES = ("special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.txt",
                          "chat_template.jinja", "chat_template.json", "spiece.model", "sentencepiece.bpe.model")


def _source_config(model: nn.Module) -> dict[str, Any]:
    """The ``config.json`` of the folder ``model`` was loaded from (its ``config._name_or_path``), or ``{}`` when it
    came from no local folder (a hub name, ``from_config``)."""
    config = getattr(unwrap_model(model, peft=True), "config", None)
    folder = Path(str(getattr(config, "_name_or_path", "") or "."))
    try:
        value = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The checkpoint dtype a config.json names (``dtype``, or ``torch_dtype`` before transformers 4.56)."""
    value = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or ""), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype``; tensors that shared storage (tied weights) still share it, so
    ``save_pretrained`` writes them once."""
    cast: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, value in state.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        key = (value.untyped_storage().data_ptr() + value.storage_offset() * value.element_size(), tuple(value.shape))
        out[name] = cast.setdefault(key, value.detach().to(dtype))
    return out


def _restore_source_fields(folder: Path, source: dict[str, Any], dtype: torch.dtype | None) -> None:
    """The fields of the written folder that training changed but the model did not: config.json's use_cache,
    architectures (not FSDP2's class) and dtype (the weights' dtype when they were cast), adapter_config.json's base
    model as an absolute path."""
    config_path = folder / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if "use_cache" in source:
            config["use_cache"] = source["use_cache"]
        # FSDP2's fully_shard renames the class FSDP<Class>; transformers records the class's name (5.25 strips it).
        if isinstance(config.get("architectures"), list):
            config["architectures"] = [str(a).removeprefix("FSDP") for a in config["architectures"]]
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            for key in ("dtype", "torch_dtype"):
                if key in config:
                    config[key] = name
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    adapter_path = folder / "adapter_config.json"
    if adapter_path.is_file():
        adapter = json.loads(adapter_path.read_text())
        base = adapter.get("base_model_name_or_path")
        if base and Path(base).is_dir():  # a local folder; a hub name stays as it is
            adapter["base_model_name_or_path"] = str(Path(base).absolute())
            adapter_path.write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, then each file as the tokenizer's source folder has it (byte for byte)
    where only the keys of a local load differ, and the source's other tokenizer files."""
    tokenizer.save_pretrained(folder)
    source = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    if not any((source / name).is_file() for name in TOKENIZER_FILES):
        return
    for path in folder.iterdir():
        original = source / path.name
        if path.suffix != ".json" or not original.is_file():
            continue
        try:
            saved, had = json.loads(path.read_text()), json.loads(original.read_text())
        except ValueError:
            continue
        if isinstance(saved, dict) and isinstance(had, dict):
            for key in _TOKENIZER_LOAD_KEYS:
                if key not in had:
                    saved.pop(key, None)
            if saved == had:
                shutil.copyfile(original, path)
            elif path.name == "tokenizer_config.json":  # the tokenizer changed (e.g. a new pad token)
                path.write_text(json.dumps(saved, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    for name in (*TOKENIZER_FILES, *_TOKENIZER_EXTRA_FILES):
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copyfile(source / name, folder / name)


# -- the Hugging Face Trainer (memtrain.hf_trainer) ------------------------------------------------------------------
_TRAINER_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # MemtrainTrainer subclasses transformers.Trainer: built on first use, so importing memtrain.hf needs no
    # transformers.
    global _TRAINER_CLASS
    if name == "MemtrainTrainer":
        if _TRAINER_CLASS is None:
            _TRAINER_CLASS = build_trainer_class(_transformers())
        return _TRAINER_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: F822 - MemtrainTrainer is built by __getattr__
    "HF_DEFAULT_CHOICES", "MemtrainTrainer", "Prepared", "trainer_choices", "apply_lora", "is_lora", "load_pretrained", "load_tokenizer",
    "lora_targets", "merge_lora", "prepare_model", "safetensors_files", "save_hf", "trainer_problems",
]
