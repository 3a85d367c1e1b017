"""A signal that reaches one rank of a 2-process run (gloo, CPU): every rank stops after the same step, the
checkpoint of that step is written once, and every rank returns normally.

Without an agreement the signalled rank went into the checkpoint's barrier while the other went on into the
next step's gradient all-reduce: both waited for each other until the collective timed out (torchrun then
killed them after 30 s).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
SIGNALLED_RANK, SIGNALLED_AT_STEP = 1, 3
TIMEOUT = timedelta(seconds=30)  # a deadlocked collective fails the test instead of hanging it
TEXT = (b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300)
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


def _worker(rank: int, init_file: str, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=TIMEOUT)
    try:
        import importlib

        import numpy as np

        from memtrain import TrainConfig, train
        from memtrain.data import split_windows
        from memtrain.models import GPT, GPTConfig

        train_module = importlib.import_module("memtrain.train")  # the module: memtrain.train is also the function
        real_loss = train_module.language_model_loss
        forwards = {"n": 0}

        def loss(model, x, y, position_ids=None):  # one micro-batch per rank and step: the n-th forward is step n's
            forwards["n"] += 1
            if rank == SIGNALLED_RANK and forwards["n"] == SIGNALLED_AT_STEP:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting this rank's host would
            return real_loss(model, x, y, position_ids)

        train_module.language_model_loss = loss
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, n_embd=32))
        data = split_windows(np.frombuffer(TEXT, dtype=np.uint8).copy(), 32)
        config = TrainConfig(max_steps=50, micro_batch_size=2, global_batch_size=4, out_dir=os.path.join(folder, "run"),
                             progress=False, sample_bytes=0, save_every=100, eval_every=1000)
        result = train(model, data, config)
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"stopped_by": result.stopped_by,
                                                                "steps": result.steps}))
        dist.barrier()  # no rank closes its connections while a peer is still using them
    finally:
        dist.destroy_process_group()
    # NOTE: the interpreter's own teardown can abort a gloo rank ("terminate called without an active exception"
    # from a thread destroyed still joinable): once the work is done and the group closed, skip it.
    os._exit(0)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_with_one_checkpoint():
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(os.path.join(folder, "init"), folder), nprocs=WORLD, join=True)
        results = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(WORLD)]
        assert results == [{"stopped_by": "SIGTERM", "steps": SIGNALLED_AT_STEP}] * WORLD, results
        checkpoints = sorted(p.name for p in Path(folder, "run", "checkpoints").iterdir())
        assert checkpoints == [f"step-{SIGNALLED_AT_STEP:07d}"], checkpoints
        steps = [json.loads(line)["step"] for line in Path(folder, "run", "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, SIGNALLED_AT_STEP + 1)), steps
