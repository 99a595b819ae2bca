#!/usr/bin/env bash
# The many-core and GPU measurements of a lent device machine (16 cores, one GPU), in the few
# minutes it is lent, as three lanes on disjoint cores so that none waits for another:
#   lane A, cores 0-7, GPU hidden: `auto` against gloo's own collectives at p=2,4,8 (issue 33's
#           device table, torch transport; two runs, one per call), then DataParallel / ZeRO-3
#           against DDP / FSDP2 at p=8;
#   lane B, cores 8-13, GPU hidden: the same at p=4, the bucket-size sweep (5m; p=2,4) and the
#           switched-import bench with its compute floor (issue 36, 4 cores);
#   lane G, cores 14-15: meshtrain train on the GPU (1b compiled, 8b full AC), each run's summary.json
#           holding the planner's prediction beside the measurement, collected (issue 34); then one
#           cp rank's ring-attention calls at CP 1, 2, 4, 8 against the planner's kernel time
#           (benchmarks/ring_rank.py: torchtitan's T2 rows, issue 34); then one GPT block's GEMMs at the
#           per-rank shapes of Megatron's H100 model table against the planner's rate
#           (benchmarks/gemm_shapes.py: its small rows, issue 34).
# Every ratio is against its peer in the same process set, interleaved; the lanes share memory
# bandwidth, which both sides of a ratio see. Each step has a time limit and writes its output as it
# goes, so a step cut short still leaves what it finished. Everything ends up in one archive,
# $OUT/lanes.tgz, since the device tool brings back only a few files. Each lane's steps took, on an
# H200 machine's 16 cores (2026-11-26): A 2 x ~165 s + 107 s; B 90 + 190 + 80 s; G 45 + 87 + 6 s.
#
#   OUT=/path bash benchmarks/device_lanes.sh [SECONDS]   (default 520: every lane ends by then)
# (A_CPUS, B_CPUS, COMPAT_CPUS and G_CPUS move the lanes, e.g. all to 0-1 to try it on two cores.)
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
A_CPUS=${A_CPUS:-0-7} B_CPUS=${B_CPUS:-8-13} COMPAT_CPUS=${COMPAT_CPUS:-8-11} G_CPUS=${G_CPUS:-14,15}

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
    # one run per call, so that a run cut short leaves the ones before it
    for run in 1 2; do
        step A "auto-table-$run" 190 taskset -c "$A_CPUS" "$PY" benchmarks/auto_table.py 1 2,4,8 \
            all_reduce,all_gather,reduce_scatter 4K,64K,1M,16M,64M "$OUT/auto-table-$run.json" --transports=torch
    done
    step A train-p8 150 taskset -c "$A_CPUS" "$PY" -m meshtrain.cli bench train --compare \
        --impls meshtrain-dp,meshtrain-zero3 --world 8 --trials 3 --json "$OUT/train-p8.json"
}
lane_b() {
    export CUDA_VISIBLE_DEVICES=""
    step B train-p4 140 taskset -c "$B_CPUS" "$PY" -m meshtrain.cli bench train --compare \
        --impls meshtrain-dp,meshtrain-zero3 --world 4 --trials 3 --json "$OUT/train-p4.json"
    step B sweep-5m 230 taskset -c "$B_CPUS" "$PY" -m meshtrain.cli bench train \
        --bucket-sweep 1,4,16,64,auto --preset 5m --world 2,4 --trials 3 --json "$OUT/sweep-5m.json"
    step B compat 110 taskset -c "$COMPAT_CPUS" "$PY" -m meshtrain.cli bench compat \
        --layouts dp4,pp2xdp2,tp2xdp2,cp2xdp2 --floor --trials 3 --json "$OUT/compat.json"
}
lane_g() {
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
lane_a & lane_b & lane_g & wait
rm -rf "$OUT/bin"
echo "device_lanes: done in $(($(date +%s) - START))s"; cat "$OUT"/[ABG].md
# one archive (the runs' checkpoints are off; their TensorBoard files are left out), then only it
t=$(mktemp) && (cd "$OUT" && tar czf "$t" --exclude=tensorboard . && rm -rf ./* && mv "$t" lanes.tgz)
