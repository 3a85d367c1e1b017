#!/usr/bin/env bash
# Every GPU check of the project, in stages of at most about 6 minutes each (a lent H200 has ~15 minutes in all
# and 10 minutes a command: run one stage per command, most important first):
#
#   benchmarks/gpu_check.sh tests     # tests/gpu: parity, peaks, races, estimate within 10%         (<= 4 min)
#   benchmarks/gpu_check.sh plan      # 1.1B Llama: plans for 8/16/24/40 GiB (+24 compiled), 5 steps  (<= 6 min)
#   benchmarks/gpu_check.sh lean      # 7B Llama in 24 GiB (or 1.1B in 4 GiB) vs no technique         (<= 6.5 min)
#   benchmarks/gpu_check.sh bench     # 1.1B Llama: checkpointing table, activation offload table    (<= 5 min)
#   benchmarks/gpu_check.sh optim     # 1.1B Llama: optimizer offload table (issue 4's targets)      (<= 4 min)
#   benchmarks/gpu_check.sh compile   # 1.1B Llama: checkpointing under torch.compile, 4 cases        (<= 6 min)
#   benchmarks/gpu_check.sh all       # every stage one after another (no lease limit)
#
# Run from the repository root; with no install, the working tree is used (PYTHONPATH=.). Results (JSON tables,
# each step's log) go to $OUT, or bench-results/ when $OUT is unset. Each command has its own time limit, so one
# hang cannot eat the lease; a failing step is reported, the next one still runs, and the exit status is 1.
set -u
stage="${1:-}"
case "$stage" in
    tests|plan|lean|bench|optim|compile|all) ;;
    *) echo "usage: benchmarks/gpu_check.sh tests|plan|lean|bench|optim|compile|all (got '${stage}')" >&2; exit 2 ;;
esac
out="${OUT:-bench-results}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-.}"
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
status=0

step() {  # step SECONDS NAME COMMAND...: runs COMMAND under a time limit, output also in $out/NAME.log
    local limit="$1" name="$2"
    shift 2
    echo "== $name (limit ${limit}s) =="
    local start=$SECONDS
    # -k: a process stuck in a CUDA call may ignore SIGTERM; SIGKILL follows 10 s later.
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s =="
    [ "$rc" -eq 0 ] || status=1
}

runs() { [ "$stage" = "$1" ] || [ "$stage" = all ]; }

"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2

if runs tests; then
    step 240 pytest-gpu "$py" -m pytest -q -p no:cacheprovider tests/gpu -s
fi
if runs plan; then
    # Issue 11: each budget in a fresh process (peaks do not add up); --deadline skips what would not finish, so
    # the table survives; the outer limit is the hard stop.
    step 360 plan "$py" benchmarks/gpu_plan.py --deadline 340 --out "$out/gpu_plan-1.1b.json"
fi
if runs lean; then
    # Issue 14: the 7B in 24 GiB (its process limited to 200 s), else the 1.1B in 4 GiB (--fallback, 90 s), then
    # the no-technique baseline (90 s).
    step 400 lean-optimizer "$py" benchmarks/gpu_lean_optimizer.py --fallback --deadline 385 \
        --out "$out/gpu_lean_optimizer.json"
fi
if runs bench; then
    step 120 checkpointing "$py" benchmarks/bench_checkpointing.py --shape llama-1.1b --device cuda --repeats 3 \
        --out "$out/checkpointing-llama-1.1b.json"
    step 170 activation-offload "$py" benchmarks/gpu_offload.py --repeats 3 --out "$out/gpu_offload.json"
fi
if runs optim; then
    # The founding document's offload (~10 s a step) is left out: DESIGN.md's anchors already measure it.
    step 230 optimizer-offload "$py" benchmarks/gpu_optim_offload.py --repeats 3 --out "$out/gpu_optim_offload.json" \
        --cases "device AdamW;memtrain offload;memtrain offload, delayed;memtrain offload, bf16 weights;memtrain offload, bf16 weights + chunked loss;torchao CPUOffloadOptimizer"
fi
if runs compile; then
    step 350 checkpointing-compiled "$py" benchmarks/bench_checkpointing.py --shape llama-1.1b --device cuda \
        --compile --repeats 3 --out "$out/checkpointing-llama-1.1b-compiled.json" \
        --cases "hf gradient_checkpointing_enable;memtrain full;memtrain full + chunked loss"
fi
exit $status
