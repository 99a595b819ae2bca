"""Argument handling and printing for ``meshtrain bench moe`` (the measurements are in ``moe.py``)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

PARTS = ("dispatch", "experts", "train")
TARGETS = {"dispatch": 3.0, "experts": 2.0, "train": 0.25}
"""shm all-to-all >= 3x gloo's; grouped experts >= 2x the loop at 8+ experts; dispatch + combine
<= 25 % of the ep2 training step."""

DEFAULTS: dict[str, Any] = {
    "world": 4, "dispatch_presets": "moe-test,moe-200m", "dispatch_batch": 8, "dispatch_seq": 128, "iters": 20,
    "experts": "8,16,32", "dim": 512, "hidden": 1024, "tokens": 2048, "top_k": 2, "reps": 1,
    "preset": "moe-200m", "batch": 4, "seq": 128, "steps": 2, "warmup": 1, "ep": 2, "timeout": 900.0,
}
TINY: dict[str, Any] = {
    "world": 2, "dispatch_presets": "moe-test", "dispatch_batch": 2, "dispatch_seq": 16, "iters": 2,
    "experts": "4,8", "dim": 32, "hidden": 64, "tokens": 64, "top_k": 2, "reps": 1,
    "preset": "moe-test", "batch": 2, "seq": 16, "steps": 1, "warmup": 1, "ep": 2, "timeout": 60.0,
}
"""``--tiny``: the moe-test model on 2 ranks and small expert matmuls (seconds; for tests)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench moe`` (a size option left out takes DEFAULTS, or TINY)."""
    d = DEFAULTS
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)} (default: all)")
    p.add_argument("--trials", type=int, default=3, help="interleaved trials per comparison; medians reported")
    p.add_argument("--tiny", action="store_true", help="tiny settings (moe-test on 2 ranks): a smoke test")
    p.add_argument("--world", type=int, help=f"process ranks for dispatch and train (default {d['world']})")
    p.add_argument("--timeout", type=float, help=f"seconds per spawned run before it fails (default {d['timeout']:g})")
    p.add_argument("--json", dest="json_path", help="write every measurement here")
    g = p.add_argument_group("dispatch: the token all-to-all, meshtrain.comm on shm vs gloo's own")
    g.add_argument("--dispatch-presets", help="models whose routing gives the splits (default "
                   f"{d['dispatch_presets']}; ep = --world)")
    g.add_argument("--dispatch-batch", type=int, help=f"global batch routed (default {d['dispatch_batch']}, "
                   "the trainer's train.global_batch)")
    g.add_argument("--dispatch-seq", type=int, help=f"tokens per sequence (default {d['dispatch_seq']}, "
                   "the trainer's train.seq_len)")
    g.add_argument("--iters", type=int, help=f"rounds (every layer's dispatch + combine) per trial (default {d['iters']})")
    g = p.add_argument_group("experts: GroupedExperts vs a per-expert Python loop, forward + backward")
    g.add_argument("--experts", help=f"comma list of expert counts (default {d['experts']})")
    g.add_argument("--dim", type=int, help=f"model dim (default {d['dim']}, moe-200m's)")
    g.add_argument("--hidden", type=int, help=f"expert hidden size (default {d['hidden']}, moe-200m's)")
    g.add_argument("--tokens", type=int, help=f"tokens routed (default {d['tokens']})")
    g.add_argument("--top-k", type=int, help=f"experts per token (default {d['top_k']})")
    g.add_argument("--reps", type=int, help=f"forward + backward passes per trial (default {d['reps']})")
    g = p.add_argument_group("train: the trainer's step at ep > 1 vs ep1, same ranks and global batch")
    g.add_argument("--preset", help=f"model (default {d['preset']})")
    g.add_argument("--batch", type=int, help=f"global batch (default {d['batch']})")
    g.add_argument("--seq", type=int, help=f"tokens per sequence (default {d['seq']})")
    g.add_argument("--steps", type=int, help=f"timed steps per trial (default {d['steps']})")
    g.add_argument("--warmup", type=int, help=f"untimed steps first (default {d['warmup']})")
    g.add_argument("--ep", type=int, help=f"expert-parallel degree compared with ep1 (default {d['ep']})")


def _fail(msg: str) -> int:
    print(f"meshtrain bench moe: error: {msg}", file=sys.stderr)
    return 2


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting: given on the command line, else TINY's (``--tiny``), else DEFAULTS'."""
    base = TINY if args.tiny else DEFAULTS
    out = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    out.update(parts=[s for s in args.parts.split(",") if s], trials=args.trials, tiny=args.tiny)
    return out


def check(c: dict[str, Any]) -> str | None:
    """What is wrong with the settings, or None."""
    from ..models.llama import PRESETS

    bad = [s for s in c["parts"] if s not in PARTS]
    if bad or not c["parts"]:
        return f"--parts: unknown or empty {bad or c['parts']}; use a comma list of {','.join(PARTS)}"
    for name in ("trials", "world", "dispatch_batch", "dispatch_seq", "iters", "dim", "hidden", "tokens", "top_k",
                 "reps", "batch", "seq", "steps", "ep"):
        if c[name] < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {c[name]}"
    if c["warmup"] < 0 or not c["timeout"] > 0:
        return f"--warmup must be >= 0 and --timeout > 0, got {c['warmup']} and {c['timeout']}"
    try:
        c["expert_counts"] = [int(e) for e in c["experts"].split(",") if e]
    except ValueError:
        return f"--experts must be a comma list of integers, got {c['experts']!r}"
    if not c["expert_counts"] or min(c["expert_counts"]) < c["top_k"]:
        return f"--experts {c['experts']}: every count must be >= --top-k {c['top_k']}"
    c["presets"] = [s for s in c["dispatch_presets"].split(",") if s]
    for preset in c["presets"] + [c["preset"]]:
        if preset not in PRESETS or not PRESETS[preset].n_experts:
            moe = sorted(k for k, v in PRESETS.items() if v.n_experts)
            return f"unknown or dense model {preset!r}: use one of {', '.join(moe)}"
    w = c["world"]
    for preset in c["presets"]:
        if PRESETS[preset].n_experts % w or c["dispatch_batch"] % w or c["dispatch_seq"] > PRESETS[preset].max_seq_len:
            return (f"dispatch: {preset} at ep {w} needs n_experts ({PRESETS[preset].n_experts}) and --dispatch-batch "
                    f"({c['dispatch_batch']}) divisible by --world {w}, and --dispatch-seq <= "
                    f"{PRESETS[preset].max_seq_len}")
    cfg = PRESETS[c["preset"]]
    if c["ep"] < 2 or w % c["ep"] or cfg.n_experts % c["ep"] or c["batch"] % w or c["seq"] > cfg.max_seq_len:
        return (f"train: --ep {c['ep']} must be >= 2 and divide --world {w} and n_experts {cfg.n_experts}; "
                f"--batch {c['batch']} must be a multiple of {w}; --seq <= {cfg.max_seq_len}")
    return None


def main(args: argparse.Namespace) -> int:
    """Run the parts; print their tables; 2 on bad input, 1 if a result is wrong (an all-to-all's
    rows, the loop's and grouped experts' results, or the two layouts' losses differ)."""
    c = resolve(args)
    err = check(c)
    if err:
        return _fail(err)
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        return _fail(f"--json: directory of {args.json_path!r} does not exist; create it first")
    from . import moe

    out: dict[str, Any] = {"config": {k: v for k, v in c.items()}, "targets": TARGETS}
    ok = True
    print(f"# meshtrain bench moe: parts {','.join(c['parts'])}; each figure the median of {c['trials']} "
          f"interleaved trials, [min-max] of the per-trial ratios")
    if "dispatch" in c["parts"]:
        t0 = time.perf_counter()
        out["dispatch"] = []
        for preset in c["presets"]:
            mats = moe.routing_matrices(preset, c["world"], c["dispatch_batch"], c["dispatch_seq"])
            from ..models.llama import PRESETS

            r = moe.run_dispatch(mats, PRESETS[preset].dim, c["iters"], 2, c["trials"], c["timeout"])
            out["dispatch"].append({"preset": preset, **r})
            ok &= not any(r["wrong"].values())
        print_dispatch(out["dispatch"], c, time.perf_counter() - t0)
    if "experts" in c["parts"]:
        t0 = time.perf_counter()
        out["experts"] = [moe.run_experts(e, c["dim"], c["hidden"], c["tokens"], c["top_k"], c["reps"], c["trials"])
                          for e in c["expert_counts"]]
        ok &= all(r["same"] for r in out["experts"])
        print_experts(out["experts"], time.perf_counter() - t0)
    if "train" in c["parts"]:
        t0 = time.perf_counter()
        r = moe.run_train(c["preset"], c["world"], [c["ep"], 1], c["batch"], c["seq"], c["steps"], c["warmup"],
                          c["trials"], c["timeout"])
        a, b = (r["layouts"][ep]["losses"] for ep in (c["ep"], 1))
        r["same_losses"] = all(math.isclose(x, y, rel_tol=1e-3) for x, y in zip(a, b))
        ok &= r["same_losses"]
        out["train"] = r
        print_train(r, c, time.perf_counter() - t0)
    if args.json_path:
        from ..files import write_json_atomic

        write_json_atomic(args.json_path, _jsonable(out))
        print(f"# wrote {args.json_path}")
    return 0 if ok else 1


def _jsonable(x: Any) -> Any:
    """Dict keys as strings (the train layouts are keyed by ep)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _trials(values: list[float], digits: int = 2) -> str:
    return f"[{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def print_dispatch(recs: list[dict[str, Any]], c: dict[str, Any], seconds: float) -> None:
    """One row per routed model."""
    t = TARGETS["dispatch"]
    print(f"\n## dispatch: token all-to-all (all_to_all_single, uneven splits, fp32), {c['world']} processes; "
          f"meshtrain.comm on shm vs torch.distributed on gloo, same processes ({seconds:.0f} s)")
    print(f"# splits: each MoE layer of the model routed at ep{c['world']} on a random global batch "
          f"{c['dispatch_batch']} x {c['dispatch_seq']}; a round = every layer's dispatch + combine")
    print(f"# {'model':<10} {'calls':>5} {'KiB/rank':>9} {'shm us':>9} {'gloo us':>9} {'gloo/shm':>9} "
          f"{'trials':>11} {'#wrong':>7}  target >= {t:g}x")
    for r in recs:
        print(f"  {r['preset']:<10} {r['calls_per_round']:>5} {r['bytes_per_rank_per_call'] / 1024:>9.0f} "
              f"{r['call_us']['meshtrain-shm']:>9.0f} {r['call_us']['gloo']:>9.0f} {r['ratio']:>9.2f} "
              f"{_trials(r['trials_ratio']):>11} {sum(r['wrong'].values()):>7}  {_verdict(r['ratio'] >= t)}")
    for r in recs:
        rows = "; ".join(str(m) for m in r["matrices"])
        print(f"# {r['preset']} rows rank i -> rank j per layer: {rows}")


def print_experts(recs: list[dict[str, Any]], seconds: float) -> None:
    """One row per expert count."""
    t = TARGETS["experts"]
    r0 = recs[0]
    print(f"\n## experts: GroupedExperts (one grouped matmul: torch._grouped_mm where it runs, else the padded bmm) vs a loop of "
          f"per-expert nn.Linear, forward + backward, dim {r0['dim']}, hidden {r0['hidden']}, "
          f"{r0['tokens']} tokens top-{r0['top_k']}, {r0['threads']} threads ({seconds:.0f} s)")
    print(f"# {'experts':>7} {'rows':>6} {'rows/expert':>12} {'grouped ms':>11} {'loop ms':>9} {'loop/grouped':>13} "
          f"{'trials':>11} {'same':>5}  target >= {t:g}x")
    for r in recs:
        print(f"  {r['experts']:>7} {r['rows']:>6} {r['min_rows']:>5}-{r['max_rows']:<6} "
              f"{r['step_s']['grouped'] * 1e3:>11.1f} {r['step_s']['loop'] * 1e3:>9.1f} {r['ratio']:>13.2f} "
              f"{_trials(r['trials_ratio']):>11} {str(r['same']):>5}  {_verdict(r['ratio'] >= t)}")


def print_train(r: dict[str, Any], c: dict[str, Any], seconds: float) -> None:
    """One row per layout, and the step's parts."""
    t = TARGETS["train"]
    print(f"\n## train: {r['preset']} training step (forward_backward, clip, AdamW), {r['world']} processes on shm, "
          f"global batch {r['batch']} x {r['seq']}, {r['steps']} timed steps after {r['warmup']} ({seconds:.0f} s)")
    print(f"# {'layout':<10} {'tokens/s':>9} {'trials':>17} {'step s':>7} {'disp+comb':>10} {'[trials]':>11} "
          f"{'a2a':>6} {'params/rank':>12}")
    for ep, lay in r["layouts"].items():
        tr = lay["trials_tokens_per_s"]
        print(f"  {lay['label']:<10} {lay['tokens_per_s']:>9.1f} {f'[{min(tr):.1f}-{max(tr):.1f}]':>17} "
              f"{lay['step_s']:>7.2f} {lay['dispatch_share'] * 100:>9.1f}% {_trials([x * 100 for x in lay['trials_dispatch_share']], 1):>11} "
              f"{lay['all_to_all_share'] * 100:>5.1f}% {lay['local_params'] / 1e6:>11.1f}M")
    ep = c["ep"]
    lay = r["layouts"][ep]
    print(f"# ep{ep} / ep1 tokens/s: {r['ratio']:.2f} {_trials(r['trials_ratio'])}; ep{ep} dispatch + combine "
          f"{lay['dispatch_share'] * 100:.1f}% of the step (target <= {t * 100:g}%: "
          f"{_verdict(lay['dispatch_share'] <= t)}); losses equal across layouts: {r['same_losses']}")
    for e, l in r["layouts"].items():
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in {**l["phases_s"], **l["parts_s"]}.items())
        print(f"# {l['label']} ms per step (mean over ranks): {parts}")
    print("# disp+comb: wall time inside the dispatcher's dispatch and combine, forward and backward (the "
          "all-to-alls, the count exchange, the permutes and gathers), over the step, mean over ranks; "
          "a2a: meshtrain.comm's all_to_all time alone")
