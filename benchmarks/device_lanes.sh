#!/usr/bin/env bash
# The many-core (and GPU) measurements of a lent device machine (16 cores, one GPU), in the few
# minutes it is lent, as lanes on disjoint cores so that none waits for another:
#   lane A, cores 0-7, GPU hidden: meshtrain's native path against torch's own (its wait mode
#           learned, fixed, the check off: benchmarks/native_paths.py), then issue 33's `auto` table
#           (auto against gloo's own collectives at p=2,4,8, torch transport), one op of one run per step;
#   lane B, cores 8-15, GPU hidden: DataParallel / ZeRO-3 against DDP / FSDP2 at p=8, DataParallel
#           against DDP at p=8 with 2 sequences a rank, then more of the auto table's runs;
#   lane G (GPU=1 only; it shares cores 14-15 with lane B): meshtrain train on the GPU (1b compiled,
#           8b full AC), each run's summary.json holding the planner's prediction beside the
#           measurement, collected (issue 34); then one cp rank's ring-attention calls at CP 1, 2, 4, 8
#           against the planner's kernel time (benchmarks/ring_rank.py), then one GPT block's GEMMs at
#           the per-rank shapes of Megatron's model table (benchmarks/gemm_shapes.py). Sessions 22 and
#           30 measured these (docs/benchmarks.md).
# Every ratio is against its peer in the same process set, interleaved; the lanes share memory
# bandwidth, which both sides of a ratio see. Each step has a time limit and writes its output as it
# goes, so a step cut short still leaves what it finished. Everything ends up in one archive,
# $OUT/lanes.tgz, since the device tool brings back only a few files. On an H200 machine's 16 cores
# (session 30): one op of the auto table at p=2,4,8 took about 95 s; the p=8 comparison 127 s;
# native_paths about 10 s per size.
#
#   OUT=/path bash benchmarks/device_lanes.sh [SECONDS]   (default 520: every lane ends by then)
# (A_CPUS, B_CPUS and G_CPUS move the lanes, e.g. all to 0-1 to try it on two cores.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-lanes}
LIMIT=${1:-520}
mkdir -p "$OUT/bin"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# benchmarks/auto_table.py calls `meshtrain`; the lent machine has no install, only its python3
printf '#!/bin/sh\nexec %s -m meshtrain.cli "$@"\n' "$PY" > "$OUT/bin/meshtrain"
chmod +x "$OUT/bin/meshtrain"
export PATH="$(cd "$OUT/bin" && pwd):$PATH"
START=$(date +%s)
A_CPUS=${A_CPUS:-0-7} B_CPUS=${B_CPUS:-8-15} G_CPUS=${G_CPUS:-14,15}

step() {  # step LANE NAME SECONDS CMD...: run CMD with at most SECONDS (and never past LIMIT)
    local lane=$1 name=$2 secs=$3; shift 3
    local left=$((LIMIT - ($(date +%s) - START)))
    ((secs > left)) && secs=$left
    if ((secs < 10)); then echo "## $name: skipped (no time left)" >> "$OUT/$lane.md"; return; fi
    echo "## $name (limit ${secs}s): $*" >> "$OUT/$lane.md"
    local t0=$(date +%s)
    timeout -k 5 "$secs" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "exit $rc after $(($(date +%s) - t0))s" >> "$OUT/$lane.md"
}

lane_a() {
    export CUDA_VISIBLE_DEVICES=""
    # meshtrain's native path (its wait mode learned, fixed, check off) against torch's own (session 30)
    step A native-paths 60 taskset -c "$A_CPUS" env NATIVE_PATHS_PROFILE=mc-park bash -c "$PY benchmarks/native_paths.py 1048576 4 5 60 all_reduce \
        torch,mc,mc-look,mc-park,mc-park-nocheck,ring && $PY benchmarks/native_paths.py 4096 8 5 60 all_gather \
        torch,mc,mc-look,mc-park,mc-park-nocheck,ring"
    # one op of one run per step, so that a step cut short leaves the ones before it
    for run_op in 1:all_reduce 1:reduce_scatter 2:all_gather 3:all_reduce; do
        auto_step A "$A_CPUS" "${run_op%%:*}" "${run_op#*:}"
    done
}
lane_b() {
    export CUDA_VISIBLE_DEVICES=""
    step B train-p8 140 taskset -c "$B_CPUS" "$PY" -m meshtrain.cli bench train --compare \
        --impls meshtrain-dp,meshtrain-zero3 --world 8 --trials 3 --json "$OUT/train-p8.json"
    # the same at 2 sequences a rank: the 19 MiB all-reduce becomes ~4x the share of a step (4.4 % at
    # 8 a rank, session 30, which bounds DataParallel over DDP at 1.046x), so overlap can show
    step B train-p8-b2 120 taskset -c "$B_CPUS" "$PY" -m meshtrain.cli bench train --compare \
        --impls meshtrain-dp --world 8 --batch 2 --trials 3 --json "$OUT/train-p8-b2.json"
    for run_op in 1:all_gather 2:all_reduce 2:reduce_scatter 3:all_gather 3:reduce_scatter; do
        auto_step B "$B_CPUS" "${run_op%%:*}" "${run_op#*:}"
    done
}
auto_step() {  # auto_step LANE CPUS RUN OP: issue 33's table for one op at p=2,4,8 (torch transport)
    step "$1" "auto-$4-$3" 110 taskset -c "$2" "$PY" benchmarks/auto_table.py 1 2,4,8 "$4" 4K,64K,1M,16M,64M \
        "$OUT/auto-$4-$3.json" --transports=torch
}
lane_g() {  # the GPU: meshtrain train's prediction rows (issue 34); not run by default (GPU=1 runs it)
    step G train-1b 200 taskset -c "$G_CPUS" "$PY" -m meshtrain.cli train --model.preset=1b --train.precision=bf16 --parallel.dp=1 --parallel.tp=1 \
        --train.compile=true --train.device=cuda --train.seq_len=2048 --train.global_batch=4 --train.steps=30 \
        --train.warmup_steps=5 --comm.transport=local --checkpoint.enabled=false --no-progress --out="$OUT/runs/1b"
    step G train-8b 150 taskset -c "$G_CPUS" "$PY" -m meshtrain.cli train --model.preset=8b --data.vocab_size=8192 \
        --train.precision=bf16 --train.device=cuda --parallel.dp=1 --parallel.tp=1 --parallel.activation_checkpointing=full --train.seq_len=2048 \
        --train.global_batch=1 --train.steps=4 --train.warmup_steps=1 --comm.transport=local \
        --checkpoint.enabled=false --no-progress --out="$OUT/runs/8b"
    step G plan-collect 30 "$PY" -m meshtrain.cli bench plan --collect "$OUT/runs"
    step G ring-rank 120 taskset -c "$G_CPUS" "$PY" benchmarks/ring_rank.py 1,2,4,8 3
    step G gemm-shapes 90 taskset -c "$G_CPUS" "$PY" benchmarks/gemm_shapes.py 20
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
nproc >> "$OUT/device.txt"
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$OUT/device.txt" 2>&1
lane_a & lane_b & { [[ ${GPU:-0} == 1 ]] && lane_g; } & wait
rm -rf "$OUT/bin"
echo "device_lanes: done in $(($(date +%s) - START))s"; cat "$OUT"/[ABG].md
# one archive (the runs' checkpoints are off; their TensorBoard files are left out), then only it
t=$(mktemp) && (cd "$OUT" && tar czf "$t" --exclude=tensorboard . && rm -rf ./* && mv "$t" lanes.tgz)
