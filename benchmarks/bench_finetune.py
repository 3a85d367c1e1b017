"""Fine-tuning a pretrained Hugging Face folder on a .jsonl file with `memtrain train` (issue 12), end to end on
this machine: full fine-tuning, LoRA, and the offloaded optimizer, side by side.

The folder is built offline as the tests build theirs (tests/conftest.py: a byte-level BPE trained on the built-in
corpus, a Llama saved with ``save_pretrained``), here a larger Llama (``--hidden``, ``--layers``); the documents
are the built-in corpus's paragraphs, one ``{"text": ...}`` per line. Each variant runs
``memtrain train --hf-model DIR --data docs.jsonl`` in this process with the same seed, data and steps, and the
table shows, from the run folder: the loss over the first and the last 4 steps, the median tokens/s of the timed
steps (all but the first 2), and from ``report.json``'s ``with_memtrain`` the bytes saved for backward, the
gradient bytes (the trainable parameters') and the optimizer state bytes on the device; and whether ``hf/`` loads with ``from_pretrained``
(``PeftModel.from_pretrained`` for LoRA). The CPU's tokens/s depend on its load: compare the variants of one run.

Run: ``.venv/bin/python benchmarks/bench_finetune.py`` (about a minute on 2 cores) or with ``--steps 40
--hidden 256 --layers 4 --out bench-results/finetune.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "tests"))

import torch  # noqa: E402

from memtrain.cli import main as memtrain_main  # noqa: E402
from memtrain.data import stdlib_corpus  # noqa: E402
from memtrain.report import format_bytes  # noqa: E402

VARIANTS = {  # name: extra flags of memtrain train
    "full": [],
    "lora 8": ["--lora", "8", "--lr", "1e-2"],
    "full, offloaded optimizer": ["--offload-optimizer"],
}


def build_folder(directory: Path, *, hidden: int, layers: int, seq_len: int) -> None:
    """A pretrained-looking folder: conftest's tokenizer, and a Llama of the given shape in safetensors."""
    import transformers
    from conftest import build_tokenizer

    tokenizer = build_tokenizer(directory)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                                      vocab_size=len(tokenizer), max_position_embeddings=max(256, seq_len),
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def write_docs(path: Path, count: int) -> None:
    text = stdlib_corpus(2**21).tobytes().decode("utf-8", "replace")
    paragraphs = [p for p in text.split("\n\n") if 80 <= len(p) <= 2000][:count]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))


def run_variant(folder: Path, docs: Path, out: Path, extra: list[str], args: argparse.Namespace) -> dict:
    argv = ["train", "--hf-model", str(folder), "--data", str(docs), "--seq-len", str(args.seq_len),
            "--max-steps", str(args.steps), "--micro-batch-size", str(args.batch), "--global-batch-size",
            str(args.batch), "--eval-every", str(args.steps), "--no-progress", "--out", str(out),
            "--lr", "3e-3", *extra]  # the folder's weights are random: pre-training's rate, not fine-tuning's 2e-5
    code = memtrain_main(argv)
    if code != 0:
        return {"error": f"memtrain train exited {code}"}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())
    losses = [m["loss"] for m in metrics]
    return {
        "loss_first4": sum(losses[:4]) / 4,
        "loss_last4": sum(losses[-4:]) / 4,
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics[2:]),
        "activation_bytes": report["with_memtrain"]["activation_bytes"],
        "gradient_bytes": report["with_memtrain"]["gradient_bytes"],
        "optimizer_state_bytes": report["with_memtrain"]["optimizer_state_bytes"],
        "plan": report["plan"]["plan"],
        "hf_loads": hf_loads(out / "hf", lora="--lora" in extra),
    }


def hf_loads(folder: Path, *, lora: bool) -> bool:
    """Whether Hugging Face opens the exported folder (the tests compare its logits within 1e-5)."""
    import transformers

    if lora:
        import peft

        config = peft.PeftConfig.from_pretrained(folder)
        base = transformers.AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path)
        peft.PeftModel.from_pretrained(base, folder)
    else:
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--docs", type=int, default=800, help="paragraphs in docs.jsonl")
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, docs = Path(tmp) / "model", Path(tmp) / "docs.jsonl"
        build_folder(folder, hidden=args.hidden, layers=args.layers, seq_len=args.seq_len)
        write_docs(docs, args.docs)
        for name, extra in VARIANTS.items():
            rows[name] = run_variant(folder, docs, Path(tmp) / name.replace(" ", "-").replace(",", ""), extra, args)
    print(f"\nLlama hidden {args.hidden} x {args.layers} layers, {args.batch} x {args.seq_len} tokens per step, "
          f"{args.steps} steps, fp32 on the CPU")
    print(f"{'variant':28} {'loss 1-4':>9} {'loss last 4':>11} {'tokens/s':>9} {'saved for bwd':>13} "
          f"{'gradients':>10} {'optim state':>11}  hf/ loads")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:28} {row['error']}")
            continue
        print(f"{name:28} {row['loss_first4']:9.3f} {row['loss_last4']:11.3f} {row['tokens_per_s']:9,.0f} "
              f"{format_bytes(row['activation_bytes']):>13} {format_bytes(row['gradient_bytes']):>10} "
              f"{format_bytes(row['optimizer_state_bytes']):>11}  {row['hf_loads']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
