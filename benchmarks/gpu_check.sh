#!/usr/bin/env bash
# The project's device check. One lease of the GPU machine has ~13 usable minutes after the machine starts and
# 10 minutes a command, and at most 8 result files come back: `quick` is the check that fits, every step under
# its own limit (the limits add up to at most 480 s, the log and 5 JSON tables: 6 files):
#
#   benchmarks/gpu_check.sh quick     # tests/gpu but the tests marked slow; the 1.1B Llama's plans at 8 GiB (eager)
#                                     # and 24 GiB (compiled); one activation-offload and one optimizer-offload
#                                     # comparison; gpu_paths.py: parameter offload (1.1B in 4 GiB), pure bf16,
#                                     # the delayed update with bf16 weights over 2 micro-batches, `memtrain train`
#                                     # under a budget below its fp32 weights, QLoRA, and FSDP2's host
#                                     # offload on one rank where the deadline leaves time           (<= 8 min)
#   benchmarks/gpu_check.sh --dry-run quick   # each step, its limit and files; last line `total <N>s`
#
# What quick leaves to the longer stages (issue 28 made room for gpu_paths.py): the plans at 24 GiB eager and
# 8 GiB compiled, each budget's process being most of a step, run in `plan` (with 16 and 40 GiB); the tests marked
# `slow` in tests/gpu (the estimate-vs-allocator sweep but its two 1.1B-shape cases, the inductor compiles) run in
# `tests`, which runs every test.
#
# QLoRA (gpu_paths.py's qlora case) needs bitsandbytes, which the device image does not have and cannot download
# (no network there); without it the case is skipped with a log line saying so. To cover it, download a manylinux
# wheel of bitsandbytes here with `pip download bitsandbytes==0.50.2 --no-deps -d wheels/` into an ignored folder
# (`echo /wheels/ >> .git/info/exclude`), pass it in the run tool's `carry` (["wheels"]), and
# `pip install --no-deps wheels/*.whl` at the start of the device command (then `benchmarks/gpu_check.sh quick`).
#
# The older, longer stages (one per command, most important first; `all` runs every one, with no lease limit):
#
#   benchmarks/gpu_check.sh tests     # tests/gpu, every test: parity, peaks, races, estimate within 5%; FSDP2's
#                                     # host offload on one rank (gpu_paths.py's fsdp-offload case)
#   benchmarks/gpu_check.sh plan      # 1.1B Llama: plans for 8/16/24/40 GiB and 8/24 GiB compiled, 5 steps
#   benchmarks/gpu_check.sh lean      # 7B Llama in 24 GiB (or 1.1B in 4 GiB) vs no technique
#   benchmarks/gpu_check.sh bench     # 1.1B Llama: checkpointing table, activation offload table
#   benchmarks/gpu_check.sh optim     # 1.1B Llama: optimizer offload table
#   benchmarks/gpu_check.sh compile   # 1.1B Llama: checkpointing under torch.compile
#   benchmarks/gpu_check.sh all       # every stage above, one after another
#
# Run from the repository root; the working tree is used (PYTHONPATH=.), with `python3` (or $PYTHON). Results go
# to $OUT (bench-results/ when unset): one log per invocation, <stage>.log, and the JSON tables the steps name.
# A step that fails or passes its limit is reported, the next one still runs, and the exit status is 1.
set -u
dry=0
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
fi
stage="${1:-}"
case "$stage" in
    quick|tests|plan|lean|bench|optim|compile|all) ;;
    *) echo "usage: benchmarks/gpu_check.sh [--dry-run] quick|tests|plan|lean|bench|optim|compile|all (got '${stage}')" >&2
       exit 2 ;;
esac
out="${OUT:-bench-results}"
export PYTHONPATH="${PYTHONPATH:-.}"
py="${PYTHON:-python3}"
log="$out/$stage.log"
status=0
total=0
files=()

step() {  # step SECONDS NAME FILES COMMAND...: COMMAND under a hard time limit; FILES (comma-separated, or -)
    # are the result files it writes into $out, besides the shared log.
    local limit="$1" name="$2" writes="$3"
    shift 3
    total=$((total + limit))
    if [ "$writes" != "-" ]; then
        local f
        IFS=',' read -r -a written <<< "$writes"
        for f in "${written[@]}"; do files+=("$f"); done
    fi
    if [ "$dry" -eq 1 ]; then
        echo "step $name limit ${limit}s writes ${writes}: $*"
        return
    fi
    echo "== $name (limit ${limit}s) ==" | tee -a "$log"
    local start=$SECONDS
    # -k: a process stuck in a CUDA call may ignore SIGTERM; SIGKILL follows 5 s later (inside the limit: the
    # command gets limit - 5 s).
    timeout -k 5 "$((limit - 5))" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s ==" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

runs() { [ "$stage" = "$1" ] || [ "$stage" = all ]; }

if [ "$dry" -eq 0 ]; then
    mkdir -p "$out"
    : > "$log"
fi
files+=("$stage.log")

step 20 environment - "$py" -c "import importlib.util as u, torch, transformers; \
assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name()); \
print('torchao', 'present' if u.find_spec('torchao') else 'absent: its comparison is skipped', \
'| bitsandbytes', 'present' if u.find_spec('bitsandbytes') else 'absent')"
if [ "$dry" -eq 0 ] && [ "$status" -ne 0 ]; then
    echo "no usable CUDA device: nothing else runs" | tee -a "$log"
    exit 2
fi

if [ "$stage" = quick ]; then
    # tests/gpu but the tests marked slow (those run in `tests`), each under tests/gpu/conftest.py's per-test limit
    # (MEMTRAIN_GPU_TEST_TIMEOUT seconds).
    # tests/gpu/test_allocator_gpu.py writes the estimate's reserved and least-memory figures beside CUDA's.
    step 80 tests-gpu allocator_gpu.json env MEMTRAIN_GPU_TEST_TIMEOUT=30 "$py" -m pytest -q -p no:cacheprovider tests/gpu \
        -m "not slow" -rfEs --durations=10 --out "$out/allocator_gpu.json"
    # Issue 11's two targets, one budget each, each in a fresh process: <= 8 GiB at >= 25k tokens/s (eager), >= 54k
    # tokens/s inside 24 GiB (compiled: compiling costs most of its time). --deadline skips a budget that would not
    # finish, so the table survives a slow step; 24 GiB eager and 8 GiB compiled run in `plan`. The deadlines below
    # leave 12 s of each step's limit (less 5 s) to start Python and print the table: they count from after imports.
    step 145 plans gpu_plan-quick.json "$py" benchmarks/gpu_plan.py --budgets 8GiB,24GiB+compile --warmup 1 \
        --repeats 3 --deadline 128 --child-timeout 95 --min-child-s 30 --out "$out/gpu_plan-quick.json"
    step 45 activation-offload gpu_offload.json "$py" benchmarks/gpu_offload.py --warmup 2 --repeats 3 \
        --cases "checkpointing;checkpointing + memtrain offload;checkpointing + torch save_on_cpu" \
        --out "$out/gpu_offload.json"
    # torchao's case is left out, with a note in the log, where torchao is not installed.
    step 45 optimizer-offload gpu_optim_offload.json "$py" benchmarks/gpu_optim_offload.py --warmup 1 --repeats 3 \
        --cases "device AdamW;memtrain offload;torchao CPUOffloadOptimizer" --out "$out/gpu_optim_offload.json"
    # Issue 28: the paths no step above runs, each case in a fresh process, one JSON (qlora skipped, with a line
    # saying so, without bitsandbytes: see the header).
    step 145 paths gpu_paths.json "$py" benchmarks/gpu_paths.py \
        --cases param-offload,memtrain-train,pure-bf16,delayed-bf16-accumulation,qlora,fsdp-offload --deadline 128 \
        --out "$out/gpu_paths.json"
fi
if runs tests; then
    step 240 pytest-gpu - "$py" -m pytest -q -p no:cacheprovider tests/gpu -s
    # Issue 31: FSDP2's host offload on one rank (quick's paths step runs it last, where its deadline leaves time).
    step 90 fsdp-offload gpu_paths-fsdp.json "$py" benchmarks/gpu_paths.py --cases fsdp-offload --deadline 85 \
        --out "$out/gpu_paths-fsdp.json"
fi
if runs plan; then
    # Issue 11: each budget in a fresh process (peaks do not add up); --deadline skips what would not finish, so
    # the table survives; the outer limit is the hard stop.
    # 8 GiB compiled came from quick (issue 28).
    step 460 plan gpu_plan-1.1b.json "$py" benchmarks/gpu_plan.py \
        --budgets 8GiB,16GiB,24GiB,40GiB,8GiB+compile,24GiB+compile --deadline 440 --out "$out/gpu_plan-1.1b.json"
fi
if runs lean; then
    # Issue 14: the 7B in 24 GiB (its process limited to 200 s), else the 1.1B in 4 GiB (--fallback, 90 s), then
    # the no-technique baseline (90 s).
    step 400 lean-optimizer gpu_lean_optimizer.json "$py" benchmarks/gpu_lean_optimizer.py --fallback \
        --deadline 385 --out "$out/gpu_lean_optimizer.json"
fi
if runs bench; then
    step 120 checkpointing checkpointing-llama-1.1b.json "$py" benchmarks/bench_checkpointing.py \
        --shape llama-1.1b --device cuda --repeats 3 --out "$out/checkpointing-llama-1.1b.json"
    step 170 activation-offload gpu_offload.json "$py" benchmarks/gpu_offload.py --repeats 3 \
        --out "$out/gpu_offload.json"
fi
if runs optim; then
    # The founding document's offload (~10 s a step) is left out: docs/design.md's anchors already measure it.
    step 230 optimizer-offload gpu_optim_offload.json "$py" benchmarks/gpu_optim_offload.py --repeats 3 \
        --out "$out/gpu_optim_offload.json" \
        --cases "device AdamW;memtrain offload;memtrain offload, delayed;memtrain offload, bf16 weights;memtrain offload, bf16 weights + chunked loss;torchao CPUOffloadOptimizer"
fi
if runs compile; then
    step 350 checkpointing-compiled checkpointing-llama-1.1b-compiled.json "$py" benchmarks/bench_checkpointing.py \
        --shape llama-1.1b --device cuda --compile --repeats 3 --out "$out/checkpointing-llama-1.1b-compiled.json" \
        --cases "hf gradient_checkpointing_enable;memtrain full;memtrain full + chunked loss"
fi

if [ "$dry" -eq 1 ]; then
    echo "files ${#files[@]}: ${files[*]}"
    echo "total ${total}s"
fi
exit $status
