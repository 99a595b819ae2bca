#!/usr/bin/env bash
# `make gpu-check`: on a machine with an NVIDIA GPU, run the CUDA tests and the GPU benchmarks in one
# command and write gpu-check/report.md. Exits non-zero without CUDA (nothing is measured then) or
# when any part fails.
#
# The interpreter is the first of .venv/bin/python and $PYTHON (default: python3) whose torch sees
# CUDA. It is used as it is, with this checkout first on PYTHONPATH: nothing is installed, so a GPU
# machine whose python3 holds a CUDA build of torch needs no .venv and no package registry (a module
# it lacks is named in the report and fails the step that needs it). Only where no interpreter
# imports torch at all is .venv bootstrapped (scripts/bootstrap.sh: pip, so a registry is needed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Two lines about an interpreter: what it is (path, Python, torch, CUDA, device), then the modules of
# meshtrain and its tests that it lacks. Exit 0: its torch sees CUDA; 1: it does not; 2: no torch.
PROBE='
import importlib.util, platform, sys
head = f"{sys.executable} (Python {platform.python_version()})"
lacks = " ".join(m for m in ("numpy", "tokenizers", "safetensors", "tqdm", "matplotlib", "yaml", "pytest",
                             "pytest_timeout", "hypothesis") if importlib.util.find_spec(m) is None)
try:
    import torch
except ImportError:
    print(f"{head}: no torch"); print(lacks); sys.exit(2)
cuda = torch.cuda.is_available()
where = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
print(f"{head}: torch {torch.__version__}, CUDA {torch.version.cuda}, {where}"); print(lacks)
sys.exit(0 if cuda else 1)'

PY="" INFO="" LACKS="" TRIED="" TORCH=0
probe() {  # probe INTERPRETER: take it if its torch sees CUDA
    local out rc info lacks
    if ! command -v "$1" >/dev/null 2>&1; then
        TRIED+=$'\n'"  $1: not found"
        return 1
    fi
    out=$("$1" -c "$PROBE" 2>/dev/null); rc=$?
    { IFS= read -r info; IFS= read -r lacks; } <<< "$out"
    TRIED+=$'\n'"  $1: ${info:-does not run (exit $rc)}"
    [ "$rc" -le 1 ] && [ -n "$info" ] && TORCH=1
    [ "$rc" -eq 0 ] || return 1
    PY=$1 INFO=$info LACKS=$lacks
}
pick() {
    if [ -x .venv/bin/python ] && probe .venv/bin/python; then return 0; fi
    probe "${PYTHON:-python3}"
}
if ! pick && [ "$TORCH" -eq 0 ]; then
    echo "gpu-check: no interpreter imports torch; bootstrapping .venv (scripts/bootstrap.sh, pip):$TRIED" >&2
    if bash scripts/bootstrap.sh; then
        probe .venv/bin/python
    else
        echo "gpu-check: bootstrapping .venv failed (no package registry?); give gpu-check a python3 that" \
             "holds a CUDA build of torch (PYTHON=/path/to/python3 make gpu-check)" >&2
        exit 1
    fi
fi
if [ -z "$PY" ]; then
    echo "gpu-check: torch sees no CUDA device in any interpreter tried; run it on a machine with an NVIDIA" \
         "GPU and a CUDA build of torch (pip install torch==2.13.0 from PyPI, or PYTHON=/path/to/python3):$TRIED" >&2
    exit 1
fi
echo "gpu-check: python $PY = $INFO${LACKS:+; lacks $LACKS (nothing is installed)}"

OUT=gpu-check
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
status=0
{
    echo "# meshtrain gpu-check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "- interpreter: \`$PY\` = $INFO, used as it is with the checkout on PYTHONPATH (nothing installed)"
    [ -z "$LACKS" ] || echo "- it lacks: $LACKS (a step that needs one fails)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$OUT.tmp/report.md"

echo "## 1. CUDA tests (pytest -m cuda)" >> "$OUT.tmp/report.md"
"$PY" -m pytest -m cuda -p no:cacheprovider -q 2>&1 | tee "$OUT.tmp/tests.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
{ echo '```'; tail -5 "$OUT.tmp/tests.txt"; echo '```'; } >> "$OUT.tmp/report.md"

echo "## 2. 1b preset, bf16, seq 2048, compiled: meshtrain train vs a plain PyTorch loop" >> "$OUT.tmp/report.md"
"$PY" -m meshtrain.cli bench loop --preset 1b --seq 2048 --batch 4 --precision bf16 --compile --device cuda \
    --steps 20 --warmup 5 --trials 3 --json "$OUT.tmp/loop-1b.json" 2>&1 | tee "$OUT.tmp/loop-1b.txt" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
{ echo '```'; tail -4 "$OUT.tmp/loop-1b.txt"; echo '```'; } >> "$OUT.tmp/report.md"

echo "## 3. 8b preset, bf16, full activation checkpointing, seq 2048: peak memory against the estimate" >> "$OUT.tmp/report.md"
# fp32 masters + gradients + AdamW's two moments are 16 bytes per parameter: 128 GB for 8B, so this
# fits only a GPU with more memory than that (an H200), on one rank (ZeRO-3 over dp 1 shards nothing)
"$PY" - "$OUT.tmp" >> "$OUT.tmp/report.md" 2>&1 <<'PYEOF' || status=1
import dataclasses, json, subprocess, sys, torch
from meshtrain.models.llama import PRESETS, Llama, num_params
out = sys.argv[1]
cfg = dataclasses.replace(PRESETS["8b"], vocab_size=8192)  # the trainer takes the tokenizer's vocabulary
with torch.device("meta"):
    n = num_params(Llama(cfg))
b, s = 1, 2048
# estimate: 16 B/parameter (fp32 weight, grad, exp_avg, exp_avg_sq) + the checkpointed fp32 residual
# stream per layer + one layer recomputed in bf16 (~34 values per token per width, Korthikanti et al.)
# + fp32 logits and their gradient
est = 16 * n + cfg.n_layers * b * s * cfg.dim * 4 + 34 * b * s * cfg.dim * 2 + 2 * b * s * cfg.vocab_size * 4
have = torch.cuda.get_device_properties(0).total_memory
print(f"- parameters {n / 1e9:.2f} B; estimate {est / 2**30:.1f} GiB; device memory {have / 2**30:.1f} GiB")
if est > have:
    print("- skipped: the estimate exceeds this GPU's memory (needs an H200-class GPU)")
    sys.exit(0)
run = f"{out}/train-8b"
cmd = [sys.executable, "-m", "meshtrain.cli", "train", "--model.preset=8b", "--data.vocab_size=8192",
       "--train.precision=bf16", "--train.device=cuda", "--parallel.dp=1", "--parallel.tp=1",
       "--parallel.activation_checkpointing=full", f"--train.seq_len={s}", f"--train.global_batch={b}",
       "--train.steps=3", "--train.warmup_steps=1", "--comm.transport=local", "--checkpoint.enabled=false",
       "--no-progress", f"--out={run}"]
res = subprocess.run(cmd, capture_output=True, text=True)
if res.returncode:
    print(f"- FAILED (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    sys.exit(1)
peak = max(json.loads(line)["peak_mem_bytes"] for line in open(f"{run}/metrics.jsonl"))
print(f"- measured peak {peak / 2**30:.1f} GiB = {peak / est:.2f} x the estimate")
PYEOF

echo "## 4. fp16 with dynamic loss scaling against bf16: 1b preset, 200 steps, seq 1024" >> "$OUT.tmp/report.md"
"$PY" - "$OUT.tmp" >> "$OUT.tmp/report.md" 2>&1 <<'PYEOF' || status=1
import json, subprocess, sys
out, final = sys.argv[1], {}
for precision in ("bf16", "fp16"):
    run = f"{out}/train-1b-{precision}"
    cmd = [sys.executable, "-m", "meshtrain.cli", "train", "--model.preset=1b", f"--train.precision={precision}",
           "--train.device=cuda", "--train.seq_len=1024", "--train.global_batch=4", "--train.steps=200",
           "--train.warmup_steps=20", "--comm.transport=local", "--checkpoint.enabled=false", "--no-progress",
           f"--out={run}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        print(f"- {precision} FAILED (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
        sys.exit(1)
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    last = sum(r["loss"] for r in rows[-10:]) / 10  # the mean of the last 10 steps: one step is noisy
    final[precision] = last
    extra = f", skipped steps {rows[-1]['skipped_steps']}, final scale {rows[-1]['loss_scale']:g}" if precision == "fp16" else ""
    print(f"- {precision}: loss (mean of the last 10 steps) {last:.4f}, {rows[-1]['tokens_per_s']:.0f} tokens/s{extra}")
gap = abs(final["fp16"] - final["bf16"]) / final["bf16"]
print(f"- fp16 vs bf16: {100 * gap:.2f} % ({'within' if gap <= 0.02 else 'OUTSIDE'} the 2 % target)")
sys.exit(0 if gap <= 0.02 else 1)
PYEOF

echo "## 4b. 8b preset with optimizer offload (ZeRO-1, masters and AdamW on the host), full AC, seq 2048" >> "$OUT.tmp/report.md"
"$PY" - "$OUT.tmp" >> "$OUT.tmp/report.md" 2>&1 <<'PYEOF' || status=1
import json, subprocess, sys, torch
out = sys.argv[1]
have = torch.cuda.get_device_properties(0).total_memory
run = f"{out}/train-8b-offload"
cmd = [sys.executable, "-m", "meshtrain.cli", "train", "--model.preset=8b", "--data.vocab_size=8192",
       "--train.precision=bf16", "--train.device=cuda", "--parallel.dp=1", "--parallel.tp=1",
       "--parallel.zero_stage=1", "--parallel.offload=optimizer", "--parallel.activation_checkpointing=full",
       "--train.seq_len=2048", "--train.global_batch=1", "--train.steps=4", "--train.warmup_steps=1",
       "--comm.transport=local", "--checkpoint.enabled=false", "--no-progress", f"--out={run}"]
res = subprocess.run(cmd, capture_output=True, text=True)
if res.returncode:
    print(f"- FAILED (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    sys.exit(1)
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
peak = max(r["peak_mem_bytes"] for r in rows)
tail = rows[1:] or rows  # the first step pays for allocation and pinning
tok = sum(r["tokens_per_s"] for r in tail) / len(tail)
print(f"- fits: peak {peak / 2**30:.1f} GiB of {have / 2**30:.1f} GiB; {tok:.0f} tokens/s, "
      f"MFU {100 * sum(r['mfu'] for r in tail) / len(tail):.1f} % (steps 2-{len(rows)})")
PYEOF

echo "## 5. The planner beside the measurements (meshtrain plan, this GPU's cluster preset)" >> "$OUT.tmp/report.md"
case "$INFO" in *H200*) CLUSTER=h200 ;; *A100*) CLUSTER=a100 ;; *) CLUSTER=h100 ;; esac
{
    echo '```'
    "$PY" -m meshtrain.cli plan --model 1b --cluster "$CLUSTER" --gpus 1 --layout dp=1 --global-batch 4 --seq 2048 \
        --precision bf16 --compile 2>&1 | tail -6
    "$PY" -m meshtrain.cli plan --model 8b --cluster "$CLUSTER" --gpus 1 --layout dp=1 --global-batch 1 --seq 2048 \
        --precision bf16 --ac full --layout dp=1,zero=1,offload=optimizer,ac=full 2>&1 | tail -6
    echo '```'
} >> "$OUT.tmp/report.md"

echo "## 6. Every run above checks the planner (meshtrain bench plan --collect: their summary.json)" >> "$OUT.tmp/report.md"
{
    echo '```'
    "$PY" -m meshtrain.cli bench plan --collect "$OUT.tmp" 2>&1 | tail -12
    echo '```'
} >> "$OUT.tmp/report.md"

rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "gpu-check: wrote $OUT/report.md with $PY (exit $status)"
exit $status
