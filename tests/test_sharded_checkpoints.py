"""Sharded checkpoints under FSDP2 (memtrain.run.shards): each rank writes its shards of the weights and the optimizer
state inside the run folder's atomic, checksummed checkpoint; a kill -9 leaves the last whole one; a resume on the
same ranks is bit-exact, one on another number of ranks reads the shards resharded; rank 0 never holds the whole
state to save it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# One thread a process: torchrun sets OMP_NUM_THREADS=1 only for several processes a node, and another thread count
# sums the matmuls in another order.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
FLAGS = ["train", "--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "8", "--max-steps", "30",
         "--save-every", "1", "--no-progress"]
# A 2-rank FSDP2 run resumed on 1 process against the uninterrupted 2-rank run: the same examples each step, their
# gradients summed in another order (fp32 rounding, which AdamW carries into the weights; measured 1.2e-7 on
# gpt-mini after 5 steps), largest weight difference.
RESHARDED_TOL = 1e-5


def _torchrun(out: Path, *extra: str, nproc: int = 2, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), "-m", "memtrain", "--", *FLAGS, "--nproc", str(nproc), "--fsdp",
                             "--out", str(out), *extra], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def _finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return out + err


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (torchrun starts its ranks in sessions of their own), from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_a_killed_fsdp2_run_resumes_bit_exact_on_its_ranks_and_resharded_on_one_process(tmp_path):
    whole = _torchrun(tmp_path / "whole")
    killed = _torchrun(tmp_path / "killed")
    checkpoints = tmp_path / "killed" / "checkpoints"
    while not (checkpoints / "step-0000003").is_dir():  # renamed into place: steps 2 and 3 are whole
        assert killed.poll() is None, killed.communicate()[1][-3000:]
        time.sleep(0.05)
    for pid in [*_descendants(killed.pid), killed.pid]:  # both ranks and the agent, wherever they were
        os.kill(pid, signal.SIGKILL)
    killed.communicate()
    _finish(whole)

    # Each checkpoint: every rank's shard file and DCP's metadata, listed in SHA256SUMS beside meta.json.
    # (An older one may be half removed: the kill may have caught the pruning after a save.)
    kept = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step-"))[-2:]
    assert len(kept) == 2, kept
    for path in kept:
        listed = sorted(line.split()[1] for line in (path / "SHA256SUMS").read_text().splitlines())
        assert listed == ["meta.json", "shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp",
                          "tensors.safetensors"], (path.name, listed)
    one = tmp_path / "one"
    shutil.copytree(tmp_path / "killed", one)
    # memtrain export of the killed run (no model.safetensors): its newest checkpoint's weights, read from its shards.
    exported = subprocess.run([sys.executable, "-m", "memtrain", "export", str(one)], env=ENV, capture_output=True,
                              text=True, timeout=600)
    assert exported.returncode == 0 and (one / "sample.txt").read_text(), exported.stderr[-3000:]
    assert f"the checkpoint of step {int(kept[-1].name[5:])}" in exported.stdout + exported.stderr, exported.stdout
    (one / "sample.txt").unlink()  # the resume below writes it again

    # The same 2 ranks: bit for bit the uninterrupted run.
    _finish(_torchrun(tmp_path / "killed", "--resume"))
    want = _weights(tmp_path / "whole")
    got = _weights(tmp_path / "killed")
    assert all(torch.equal(got[k], want[k]) for k in want)

    # One process, its newest checkpoint's rank-1 shard damaged: the one before it, read onto one process.
    newest = sorted(p for p in (one / "checkpoints").iterdir() if p.name.startswith("step-"))[-1]
    shard = newest / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit pattern flipped in the middle of its tensors
    shard.write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "memtrain", *FLAGS, "--nproc", "1", "--no-fsdp", "--out", str(one),
                           "--resume"], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert f"skipped a damaged checkpoint: {newest.name}" in log and "1 rank(s) now, 2 in the run" in log, log
    got = _weights(one)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= RESHARDED_TOL, worst
    assert max(w.abs().max().item() for w in want.values()) > 100 * RESHARDED_TOL  # the check can fail


# -- rank 0's host memory while it saves ----------------------------------------------------------------------
WORLD = 2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _save_worker(rank: int, init_file: str, folder: str, results: str) -> None:
    from memtrain.models import GPT, GPTConfig
    from memtrain.planner import PlanSettings, apply_plan
    from memtrain.run import RunCheckpoints, save_run_state
    from memtrain.run.gathered import write_gathered_weights
    from memtrain.run.state import CheckpointExtra, model_state_dict, tied_duplicates

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=512, seq_len=16, dropout=0.0))  # 13M parameters
        settings = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep",) * 4, flavor="full",
                                chunked_loss=False, optimizer="device", distribution="fsdp2", compile=False,
                                precision="fp32")
        run = apply_plan(model, settings, lr=1e-3)
        x = torch.randint(0, 256, (1, 16))
        with run.accumulator.micro_batch(is_last=True):
            run.accumulator.backward(run.train_model(x, x, reduction="sum"), reduction="sum", items=16)
        run.accumulator.step()  # AdamW's moments made: the whole state is 16 bytes a parameter
        full = 16 * sum(p.numel() for p in model.parameters())
        checkpoints = RunCheckpoints(folder) if rank == 0 else None

        def peak_of(save) -> int:
            """Rank 0's resident memory at its highest during ``save``, over what it was before."""
            before, peak, done = _rss(), [0], threading.Event()

            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], _rss())
                    time.sleep(0.0005)

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                save()
            finally:
                done.set()
                sampler.join()
            return max(peak[0], _rss()) - before

        sharded = peak_of(lambda: save_run_state(checkpoints, 1, 1, model, run.optimizer, _Stub(), None, _Stub(),
                                                 _identity(), CheckpointExtra(plan_settings=settings, plan_request={}),
                                                 device=torch.device("cpu")))
        # What saving the whole state took before: every rank's shards gathered on rank 0.
        gathered = peak_of(lambda: model_state_dict(model))
        # The end of the run's model.safetensors, one gathered tensor at a time, against the whole state's.
        path = Path(folder) / "model.safetensors"
        streamed = peak_of(lambda: write_gathered_weights(path if rank == 0 else None, model, None,
                                                          torch.device("cpu")))
        whole = model_state_dict(model)
        if rank == 0:
            written = load_file(path)
            same = (sorted(written) == sorted(set(whole) - tied_duplicates(model))
                    and all(torch.equal(written[k], whole[k]) for k in written))
            torch.save({"full": full, "sharded": sharded, "gathered": gathered, "streamed": streamed,
                        "same": same}, results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _Stub:
    """A scheduler's or accumulator's state: empty."""

    def state_dict(self) -> dict:
        return {}


def _identity():
    from memtrain.run.identity import DataFingerprint, ModelFingerprint, RunIdentity

    return RunIdentity(seed=0, global_batch_size=2, world_size=WORLD, seq_len=16,
                       data=DataFingerprint(examples=1, sha256="0", of="tokens"),
                       model=ModelFingerprint(class_name="GPT", shapes={}), precision="fp32", min_lr_ratio=0.1,
                       weight_decay=0.0, grad_clip=1.0, fsdp=True, lr_schedule="cosine", adam_betas=(0.9, 0.95),
                       adam_eps=1e-8, offload_optimizer=False, optimizer="AdamW")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident memory from /proc")
def test_rank_0_saves_an_fsdp2_checkpoint_holding_its_shard_not_the_whole_state(monkeypatch):
    """Rank 0's resident memory while it saves a 2-rank FSDP2 checkpoint of 13M parameters (208 MB of weights and
    AdamW state): under half the whole state (it writes its own shards), where gathering the whole weights alone
    (the save before sharded checkpoints, and the end-of-run model.safetensors before it was streamed) takes at
    least their 52 MB on it; and while it writes model.safetensors, one gathered tensor at a time."""
    # Every allocation of 64 KiB or more its own mapping, returned to the system when freed (glibc's threshold
    # otherwise rises to 32 MiB, and a freed tensor's memory serves the next one unseen): resident memory follows
    # the tensors alive.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as folder:
        results = os.path.join(folder, "results.pt")
        mp.spawn(_save_worker, args=(os.path.join(folder, "init"), folder, results), nprocs=WORLD, join=True)
        r = torch.load(results)
    same = r.pop("same")
    assert r["sharded"] < r["full"] / 2, {k: v / 2**20 for k, v in r.items()}
    print({k: f"{v / 2**20:.1f} MiB" for k, v in r.items()})
    assert r["gathered"] >= r["full"] / 4 * 0.9, {k: v / 2**20 for k, v in r.items()}  # the check can fail
    # The end of the run: model.safetensors written one gathered tensor at a time (the largest is 4 MiB), under a
    # quarter of the 52 MB of weights a whole gathering holds; the file holds what that gathering does, bit for bit.
    assert same and r["streamed"] < r["full"] / 16, {k: v / 2**20 for k, v in r.items()}


@pytest.mark.slow
def test_a_whole_checkpoint_resumed_under_fsdp2_is_refused_naming_fsdp(tmp_path):
    """A one-process run's checkpoint holds its optimizer state by parameter index, which FSDP2's shards do not read:
    its resume with --fsdp is one clear error (it was every checkpoint "damaged", a KeyError each)."""
    out = tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "memtrain", *FLAGS[:FLAGS.index("--max-steps")], "--max-steps", "2",
                           "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = _torchrun(out, "--resume", "--max-steps", "3")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode != 0 and "does not read into FSDP2's shards" in err and "damaged" not in err, err[-3000:]


class _Calls:
    """Unpickles as a call of os.getcwd: what a crafted .metadata could make torch's own reader run."""

    def __reduce__(self):
        return os.getcwd, ()


def test_a_shards_metadata_naming_anything_but_dcps_records_is_not_unpickled(tmp_path):
    """torch's DCP reader pickle.loads shards/.metadata and torch.loads the non-tensor entries with
    weights_only=False; memtrain's reads build nothing but DCP's own records (its checksums only show damage)."""
    import pickle

    from memtrain.run.checkpoints import CheckpointDamaged
    from memtrain.run.shards import shard_weights

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / ".metadata").write_bytes(pickle.dumps(_Calls()))
    with pytest.raises(CheckpointDamaged, match="names posix.getcwd, which is no part of DCP.s metadata"):
        shard_weights(shards)


def test_a_sharded_state_is_refused_by_the_one_process_offloaded_optimizer_naming_fsdp(tmp_path):
    """FSDP2's shards hold a torch optimizer's state; memtrain's CPUOffloadOptimizer (one process's offloaded
    optimizer) keeps its own layout: a resume there is one clear error naming --fsdp, read before any shard."""
    from memtrain.errors import ConfigError
    from memtrain.optim import CPUOffloadOptimizer
    from memtrain.run.shards import load_shards

    model = torch.nn.Linear(4, 4)
    optimizer = CPUOffloadOptimizer(model.named_parameters(), lr=1e-3)
    try:
        with pytest.raises(ConfigError, match="CPUOffloadOptimizer.*To resolve this error, resume with fsdp=True"):
            load_shards(tmp_path / "shards", model, optimizer)
    finally:
        optimizer.close()


def test_a_full_disk_while_the_shards_are_written_is_one_write_fault_naming_the_last_good_checkpoint(tmp_path,
                                                                                                      monkeypatch):
    """DCP gathers every rank's failure into one CheckpointException (a trace, exit 1 as an internal error); a full
    disk is an environment fault: one RunWriteError naming the folder, the space and the intact checkpoint, and no
    temporary folder left."""
    import errno

    from torch.distributed.checkpoint import filesystem

    from memtrain.models import GPT, GPTConfig
    from memtrain.planner import PlanSettings, apply_plan
    from memtrain.run import RunCheckpoints, save_run_state
    from memtrain.run.checkpoints import RunWriteError
    from memtrain.run.state import CheckpointExtra

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, dropout=0.0))
        settings = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep",) * 2, flavor="full",
                                chunked_loss=False, optimizer="device", distribution="fsdp2", compile=False,
                                precision="fp32")
        run = apply_plan(model, settings, lr=1e-3)
        checkpoints = RunCheckpoints(tmp_path / "run")

        def save(step):
            save_run_state(checkpoints, step, 1, model, run.optimizer, _Stub(), None, _Stub(), _identity(),
                           CheckpointExtra(plan_settings=settings, plan_request={}), device=torch.device("cpu"))

        save(1)

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", full)
        with pytest.raises(RunWriteError) as info:
            save(2)
    finally:
        dist.destroy_process_group()
    message = str(info.value)
    assert "No space left on device" in message and "step-0000001, is intact" in message, message
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-0000001"]


def _write_fault_worker(rank: int, init_file: str, folder: str) -> None:
    import errno
    import io

    from memtrain.models import GPT, GPTConfig
    from memtrain.planner import PlanSettings, apply_plan
    from memtrain.run import RunCheckpoints, gathered
    from memtrain.run.checkpoints import RunWriteError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, dropout=0.0))
        settings = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep",) * 2, flavor="full",
                                chunked_loss=False, optimizer="device", distribution="fsdp2", compile=False,
                                precision="fp32")
        apply_plan(model, settings, lr=1e-3)
        out = Path(folder) / "run"
        if rank == 0:
            class Full(io.FileIO):  # the disk fills after the header: the third write fails
                writes = 0

                def write(self, data):
                    Full.writes += 1
                    if Full.writes > 2:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return super().write(data)

            gathered.open = Full  # the module's open (it shadows the builtin)
        try:
            gathered.write_gathered_weights(out / "model.safetensors" if rank == 0 else None, model,
                                            RunCheckpoints(out) if rank == 0 else None, torch.device("cpu"))
            outcome = "written"
        except RunWriteError as e:
            outcome = str(e)
        Path(folder, f"outcome{rank}").write_text(outcome)
        dist.barrier()  # both ranks reached it: neither waits for a gather the other skipped
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_full_disk_while_the_end_of_run_weights_stream_is_one_write_fault_on_every_rank(tmp_path):
    """model.safetensors written one gathered tensor at a time: a write that fails on rank 0 leaves the gathers
    going (rank 1 waits in each), and every rank raises one RunWriteError; no file, finished or temporary, is left."""
    (tmp_path / "run").mkdir()
    mp.spawn(_write_fault_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    first, second = ((tmp_path / f"outcome{r}").read_text() for r in range(WORLD))
    assert "No space left on device" in first and "model.safetensors" in first, first
    assert "rank 0 could not write" in second and "No space left on device" in second, second
    assert list((tmp_path / "run").iterdir()) == [], list((tmp_path / "run").iterdir())
