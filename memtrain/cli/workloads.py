"""The model and the data the flags name: a GPT preset (--model), a Hugging Face config (--hf-config) or pretrained
folder (--hf-model), with LoRA (--lora); its sequence length (--seq-len); the --data file's checks; and the model
on the meta device for estimate and plan."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import Any

import torch

from memtrain.cli.terms import HF_MODEL_PATH, LORA_FLAGS, call_site_flags
from memtrain.data.corpus import is_jsonl
from memtrain.data.documents import separator_note
from memtrain.errors import ConfigError
from memtrain.estimate import hf_config_from_file, meta_model
from memtrain.hf import apply_lora, load_pretrained, lora_targets
from memtrain.hf_config import checked_config
from memtrain.models import GPT, GPT_PRESETS
from memtrain.precision import resolve_precision
from memtrain.quantize import (
    fsdp_shards_4bit,
    is_quantized,
    mark_lora_clones,
    quantize_base,
    quantized_bytes,
    weight_count,
)
from memtrain.report import format_bytes


def build_language_model(args: argparse.Namespace, device: torch.device | None = None) -> tuple[Any, int]:
    """The model (LoRA adapters added with --lora) and its sequence length; ``device``: where it will train, whose
    precision (--precision, or auto's choice) decides the dtype of the frozen linear weights (``with_lora``)."""
    if args.hf_model:
        # fp32 weights whatever the checkpoint holds: the master weights of mixed precision (autocast computes in
        # bf16), which the optimizer needs; the plan may still put bf16 copies on the device (offloaded master).
        with call_site_flags(HF_MODEL_PATH):
            model = load_pretrained(args.hf_model)
        seq_len = hf_seq_len(model.config, args.seq_len, "--hf-model")
    elif args.hf_config:
        model, seq_len = _build_hf_model(args.hf_config, args.seq_len)
    else:
        model = _build_gpt(args)
        seq_len = model.config.seq_len
    precision = resolve_precision(device, args.precision)[0] if device is not None and args.lora else None
    return with_lora(model, args, precision, device=device), seq_len


def with_lora(model: Any, args: argparse.Namespace, precision: str | None = None, *,
              device: torch.device | None = None) -> Any:
    """``model`` with --lora's adapters on its frozen weights (``model`` itself without --lora). On a meta-device
    model the adapters are meta parameters too, trainable beside the frozen base: what estimate and plan trace.

    Under a mixed ``precision`` the frozen linear weights are stored in its compute dtype: half their bytes, and
    the same numbers, since autocast casts them to that dtype for every matmul anyway (they take no update, so they
    need no fp32 master). The other frozen weights (embeddings, norms) keep their dtype: they are used outside
    matmuls, where the cast would change the numbers.

    With --quantize-base nf4 (QLoRA) the adapted linear layers are first quantised to 4 bits (on ``device``; stand-ins
    on the meta device), computing in the autocast dtype (fp32 without autocast): ``memtrain.quantize``."""
    if not args.lora:
        return model
    check_lora_rank(model, args.lora)
    quantize = getattr(args, "quantize_base", None)
    if quantize:
        quantize_base(model, quantize, compute_dtype=_AUTOCAST_DTYPES.get(precision or "", torch.float32),
                      device=device)
    with call_site_flags(LORA_FLAGS):
        lora = apply_lora(model, args.lora, alpha=args.lora_alpha, dropout=args.lora_dropout or 0.0,
                          target_modules=args.lora_targets)
    if quantize:
        mark_lora_clones(lora)
    dtype = _AUTOCAST_DTYPES.get(precision or "")
    if dtype is not None:
        frozen_linear_weights_to(lora, dtype)
    return lora


_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def frozen_linear_weights_to(model: Any, dtype: torch.dtype) -> None:
    """The frozen ``nn.Linear`` weights and biases of ``model`` in ``dtype``, in place; a parameter another kind of
    module shares (an output head tied to the embedding) is left as it is."""
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not is_quantized(m)]  # 4-bit: as is
    in_linear = {id(p) for m in linear for p in m.parameters(recurse=False)}
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
                 for p in m.parameters(recurse=False)}
    done: dict[int, torch.nn.Parameter] = {}  # one new parameter per old one: ties between linear layers survive
    for m in linear:
        for name, p in m.named_parameters(recurse=False):
            if not p.requires_grad and p.is_floating_point() and id(p) in in_linear - elsewhere:
                if id(p) not in done:
                    done[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                setattr(m, name, done[id(p)])


def start_up_notes(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    """The start-up lines for set-ups that run but train less than they seem to: --data packed with no token
    between documents (a tokenizer without eos/bos), --lora on random weights (--hf-config, the built-in GPT)."""
    notes = []
    note = separator_note(tokenizer) if tokenizer is not None else None
    if note:
        notes.append(f"note: {note}")
    if args.lora and not args.hf_model:
        base = f"--hf-config {args.hf_config!r}" if args.hf_config else f"--model {args.model}"
        notes.append(f"Hint: --lora {args.lora} on {base}, whose weights are random: LoRA adapts a pretrained model "
                     "through small updates, and adapters on a random base learn little (the base stays random). To "
                     "fine-tune, pass --hf-model DIR (a pretrained folder); to train from scratch, drop --lora.")
    return notes


def lora_flag_problems(args: argparse.Namespace) -> list[str]:
    """One problem per LoRA option given without --lora (nothing to apply it to)."""
    problems = []
    # What each option would do to the adapters (a flag's own words read "no adapters to -lora", "to targets").
    verbs = {"merge_lora": "merge", "lora_alpha": "scale", "lora_dropout": "apply dropout to",
             "lora_targets": "place"}
    for dest, verb in verbs.items():
        if getattr(args, dest, None) not in (None, False) and not args.lora:
            flag = "--" + dest.replace("_", "-")
            problems.append(f"{flag} without --lora: there are no adapters to {verb}. To resolve this error, "
                            f"pass --lora R (e.g. --lora 8), or drop {flag}.")
    return problems + quantize_flag_problems(args)


def quantize_flag_problems(args: argparse.Namespace) -> list[str]:
    """One problem per option --quantize-base cannot take: no --lora (a 4-bit base takes no updates), the built-in
    GPT, --merge-lora, --offload-weights, and --fsdp on a torch whose FSDP2 cannot shard the packed 4-bit weights
    (``memtrain.quantize.fsdp_shards_4bit``; on a newer one they are sharded like any other)."""
    if not getattr(args, "quantize_base", None):
        return []
    flag = f"--quantize-base {args.quantize_base}"
    problems = []
    if not args.lora:
        problems.append(f"{flag} without --lora: 4-bit base weights take no updates, so nothing would train. To "
                        f"resolve this error, pass --lora R (e.g. --lora 16) to train adapters on them (QLoRA), or "
                        f"drop {flag}.")
    if not (args.hf_model or args.hf_config):
        problems.append(f"{flag} with the built-in GPT (--model {args.model}): QLoRA fine-tunes a pretrained Hugging "
                        "Face model, and memtrain quantises only those. To resolve this error, pass --hf-model DIR "
                        f"(or --hf-config PATH to plan), or drop {flag}.")
    if getattr(args, "merge_lora", False):
        problems.append(f"--merge-lora with {flag}: merging the adapters into 4-bit weights would round the update "
                        "away (and re-quantise the base). To resolve this error, drop --merge-lora: hf/ then holds "
                        "the adapters, which load onto the unquantised base (PeftModel.from_pretrained(base, "
                        "'RUN/hf')) and merge there (.merge_and_unload()).")
    if getattr(args, "fsdp", False) and not fsdp_shards_4bit():
        problems.append(f"--fsdp with {flag} on torch {torch.__version__}: its FSDP2 cannot shard the packed 4-bit "
                        "weights (uint8 parameters: pytorch#177844, fixed in torch 2.12). To resolve this error, "
                        "install torch 2.12 or newer (pip install 'torch>=2.12'), or drop --fsdp (DDP holds the small "
                        "4-bit base whole on each rank).")
    if getattr(args, "offload_weights", None):
        problems.append(f"--offload-weights with {flag}: parameter offload streams the weights the optimizer "
                        "trains from its host master, and the frozen 4-bit base (a quarter of the bf16 bytes) stays on "
                        "the device. To resolve this error, drop --offload-weights, or drop --quantize-base.")
    return problems


def lora_text(model: Any, rank: int) -> str:
    """The adapters in one phrase: their rank and trainable parameters beside the frozen base's."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = weight_count(model) - trainable
    share = 100 * trainable / (trainable + frozen)
    return (f"LoRA rank {rank}: {_count(trainable)} trainable parameters ({share:.2f}%) beside {_count(frozen)} "
            f"frozen ones, which take no gradients and no optimizer state{quantized_text(model)}"
            f"{frozen_dtype_text(model)}")


def quantized_text(model: Any) -> str:
    """'; 6.98B of them in 4-bit NF4 (...)' for a QLoRA model, else ''."""
    weights = sum(m.in_features * m.out_features for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and is_quantized(m))
    if not weights:
        return ""
    stored = sum(quantized_bytes(m.in_features * m.out_features) for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and is_quantized(m))
    return (f"; {_count(weights)} of them in 4-bit NF4 (--quantize-base: {format_bytes(stored)} with their fp32 "
            "scales, dequantised to the compute dtype for each matmul)")


def frozen_dtype_text(model: Any) -> str:
    """'; the frozen linear weights in bf16 (...)' where ``with_lora`` stored them so, else ''."""
    dtypes = {p.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False) if not p.requires_grad}
    half = sorted(name.removesuffix("-mixed") for name, dtype in _AUTOCAST_DTYPES.items() if dtype in dtypes)
    which = "the other frozen linear weights (the output head)" if is_quantized(model) else "the frozen linear weights"
    return (f"; {which} stored in {' and '.join(half)}, the dtype autocast computes them in (the same numbers in half "
            "the bytes)") if half else ""


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def check_lora_rank(model: Any, rank: int) -> None:
    """--lora R must not exceed the rank a layer it adapts can have, min(in, out): above it the adapters hold more
    numbers than the weight they update and add no capacity (a typo such as --lora 100000 would run on)."""
    modules = dict(model.named_modules())
    sizes = [(min(modules[n].in_features, modules[n].out_features), n) for n in lora_targets(model)]
    if not sizes:
        return  # apply_lora names the missing layers
    smallest, name = min(sizes)
    if rank > smallest:
        layer = modules[name]
        raise ConfigError(f"--lora {rank} is above the rank of the layers it adapts: the smallest, {name}, is "
                          f"{layer.in_features} x {layer.out_features}, of rank at most {smallest}. To resolve this "
                          f"error, pass --lora {smallest} or less (8 to 64 is usual).")


def check_vocabulary(folder: str, tokens: int) -> None:
    """The --hf-model tokenizer's ids must index the model's embedding: a larger tokenizer would fail mid-step
    with an IndexError on its first id past the end."""
    config = hf_folder_config(folder)
    rows = getattr(config, "vocab_size", None)
    if isinstance(rows, int) and tokens > rows:
        raise ConfigError(f"--hf-model {folder!r}: the tokenizer has {tokens} tokens but the model's embedding "
                          f"holds {rows} (vocab_size in config.json): ids {rows} and above would index past it. "
                          "To resolve this error, pass the folder the tokenizer belongs to, or resize the model "
                          f"once (model.resize_token_embeddings({tokens}); model.save_pretrained(DIR)).")


# Encoder model types whose causal-LM class attends both ways unless the config says is_decoder.
_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "electra", "camembert", "ernie",
                       "data2vec-text", "rembert", "roformer", "megatron-bert", "xmod", "big_bird", "bert-generation"})


def _build_gpt(args: argparse.Namespace) -> Any:
    """The --model preset, with --seq-len applied."""
    if args.model not in GPT_PRESETS:
        raise ConfigError(f"--model {args.model!r} is not a known model. To resolve this error, pass one of "
                          f"{', '.join(GPT_PRESETS)}, --hf-config PATH or --hf-model DIR.")
    return GPT.from_preset(args.model, **({"seq_len": args.seq_len} if args.seq_len else {}))


# --seq-len's default for Hugging Face models, in train, plan and estimate alike (a plan predicts the run).
HF_SEQ_LEN = 256


def hf_seq_len(config: Any, seq_len: int | None, flag: str, *, default: int = HF_SEQ_LEN,
               problems: list[str] | None = None) -> int:
    """--seq-len, or ``default`` capped at the model's positions; a causal LM only (not an encoder)."""
    own = problems is None
    problems = [] if problems is None else problems
    if config.model_type in _ENCODERS and not getattr(config, "is_decoder", False):
        problems.append(f"{flag}: a {config.model_type} config is an encoder: trained on next tokens it would "
                        "see the tokens it predicts. To resolve this error, set \"is_decoder\": true in the config, "
                        "or use a decoder model (llama, gpt2, qwen2, ...).")
    max_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    wanted = seq_len or min(default, max_len or default)
    if max_len is not None and wanted > max_len:
        problems.append(f"--seq-len {wanted} is longer than the model's {max_len} positions. To resolve this "
                        f"error, pass --seq-len {max_len} or less.")
    if own:
        ConfigError.raise_if(problems)
    return wanted


def _build_hf_model(path: str, seq_len: int | None) -> tuple[Any, int]:
    config = hf_config_file(path)  # plain JSON: nothing executed; every bad field is a ConfigError
    problems: list[str] = []
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 256:
        problems.append(f"--hf-config: vocab_size={vocab!r} must be an integer >= 256: the data is byte-level. To "
                        "resolve this error, set vocab_size >= 256 in the config.")
    wanted = hf_seq_len(config, seq_len, "--hf-config", problems=problems)
    ConfigError.raise_if(problems)
    # Random weights: a config.json saved by transformers 4 names its hub model, which would read as pretrained
    # weights (memtrain.schedule.pretrained_source) and give fine-tuning's learning rate.
    config._name_or_path = ""
    import transformers  # an optional extra, seconds to import: only --hf-config pays for it

    try:
        # fp32 weights whatever the config's torch_dtype (memtrain.estimate.fake.meta_model says why).
        return transformers.AutoModelForCausalLM.from_config(config).float(), wanted
    except Exception as e:  # noqa: BLE001 - transformers refuses configs with exceptions of many types
        cause = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"--hf-config {path!r}: transformers cannot build a causal language model from this "
                          f"{config.model_type} config ({type(e).__name__}: {cause[:400]}"
                          f"{'...' if len(cause) > 400 else ''}). To resolve this error, pass the config of a "
                          "decoder model (llama, gpt2, qwen2, ...) whose sizes are positive.") from None


def hf_folder_config(path: str) -> Any:
    """The config.json of a --hf-model folder (only that file is read)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--hf-model {path!r}: no such folder. To resolve this error, pass a local folder holding "
                          "config.json (and, to train, *.safetensors weights and a tokenizer).")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--hf-model {path!r} holds no config.json, so the architecture is unknown. To resolve "
                          "this error, pass the folder save_pretrained wrote (config.json beside the weights).")
    return hf_config_file(folder / "config.json", where=f"--hf-model {path!r}: config.json")


def hf_config_file(path: str | os.PathLike[str], *, where: str | None = None) -> Any:
    """The ``PretrainedConfig`` of a config.json (``--hf-config PATH``, or ``where`` names it), checked before any
    model is built from it: sizes left to transformers' defaults and values that cannot make a model are one
    ConfigError (``memtrain.hf_config``)."""
    return checked_config(path, lambda: hf_config_from_file(path), where=where or f"--hf-config {str(path)!r}")


def check_data_path(path: str, *, tokenised: bool, flag: str = "--data") -> None:
    """--data (or ``flag``'s file) must be a readable regular text file: a directory or a FIFO would fail late or
    block forever. ``tokenised``: a model tokenizer reads it, so .jsonl is read too (bytes otherwise)."""
    p = Path(path)
    shown = f"{flag} {path!r}"
    if not p.exists():
        what = "a symbolic link to nothing" if os.path.islink(p) else "no such file"
        raise ConfigError(f"{shown}: {what}. To resolve this error, pass the path of a text file.")
    if p.is_dir():
        raise ConfigError(f"{shown} is a directory. To resolve this error, pass the path of a text file in it.")
    if not stat.S_ISREG(p.stat().st_mode):
        raise ConfigError(f"{shown} is not a regular file (a FIFO, socket or device: reading it could block or "
                          "never end). To resolve this error, pass the path of a text file.")
    if is_jsonl(p) and not tokenised:
        raise ConfigError(f"{shown} is a .jsonl file, which only a model with a tokenizer reads (the built-in GPT "
                          "and --hf-config models read bytes: they would train on the raw JSON). To resolve this "
                          "error, pass --hf-model DIR (a folder with a tokenizer), or a plain .txt file of the texts.")
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{shown} is not readable. To resolve this error, pass a text file you can read.")


def meta_target(args: argparse.Namespace) -> tuple[Any, int, str]:
    """(the model on the meta device, with --lora's adapters, tokens per example, its name) for estimate and plan:
    nothing allocated."""
    if args.hf_config or args.hf_model:
        config = hf_config_file(args.hf_config) if args.hf_config else hf_folder_config(args.hf_model)
        flag = "--hf-config" if args.hf_config else "--hf-model"
        seq_len = hf_seq_len(config, args.seq_len, flag)
        name = Path(args.hf_config).name if args.hf_config else Path(args.hf_model).name
        return with_lora(meta_model(config), args, args.precision), seq_len, name
    with torch.device("meta"):
        model = _build_gpt(args)
    return with_lora(model, args, args.precision), model.config.seq_len, args.model


def trains_packed_rows(args: argparse.Namespace) -> bool:
    """Whether ``memtrain train`` with these flags feeds packed rows: --hf-model tokenises --data into documents
    packed several to a row, whose restarting position_ids make a Hugging Face model build a block-diagonal mask."""
    return bool(args.hf_model)


def meta_batch(args: argparse.Namespace, micro_batch_size: int, seq_len: int) -> Any:
    """The batch ``memtrain train`` passes, as shapes for estimate: token ids, or for packed rows the three
    tensors its loop passes (input_ids, labels, position_ids)."""
    shape = (micro_batch_size, seq_len)
    return dict.fromkeys(("input_ids", "labels", "position_ids"), shape) if trains_packed_rows(args) else shape
