"""Argument handling for ``meshtrain train``: the config file, ``--section.key=value`` overrides,
``--print-config``, ``--out`` and ``--max-restarts``."""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain train`` (every config key is also an option: --train.lr=1e-3)."""
    p.add_argument("--config", help="a TOML file; --section.key=value options override it")
    p.add_argument("--out", help="run directory (default runs/<date-time>)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the workers up to K times after a failure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar: a '# step S/N: ...' line every "
                   "train.print_every steps instead (0: about 20 a run), for logs")
    p.add_argument("--world-size", type=int, help="start this many ranks instead of dp x tp x pp x cp; needs "
                   "elastic.enabled, which chooses the layout for them (as after a torchrun membership change)")


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Resolve the config, then print it or run it; errors exit 2 with the reason. SIGINT / SIGTERM
    (``interrupt.py``) end it in one line with exit 130 / 143: after a step boundary's checkpoint
    while the ranks train, at once before they start or on a second SIGINT."""
    from . import interrupt

    seen: dict = {}  # the config, once loaded: what the interrupt line names
    with interrupt.guard():
        try:
            return _main(args, overrides, seen)
        except interrupt.Interrupted as exc:
            config = seen.get("config")
            if seen.get("done"):  # the ranks had ended: nothing of the run is lost
                print(f"meshtrain train: interrupted by {interrupt.signal_name(exc.signum)} after training finished: "
                      f"the run is complete, only the planner's check was skipped (exit code "
                      f"{interrupt.exit_code(exc.signum)})", file=sys.stderr, flush=True)
                return interrupt.exit_code(exc.signum)
            root = os.path.join(config.out, config.checkpoint.dir) if config is not None and config.out else None
            what = "again" if exc.again else "ended" if seen.get("launched") else "early"
            print("meshtrain train: " + interrupt.unsaved_line(exc.signum, what, root, interrupt.resume_command(),
                                                               config is None or config.checkpoint.enabled),
                  file=sys.stderr, flush=True)
            return interrupt.exit_code(exc.signum)


def _resume_command(args: argparse.Namespace, overrides: list[str], out: str) -> str:
    """``meshtrain train`` as it was called, with ``--out OUT --checkpoint.resume=auto``."""
    from .interrupt import resume_argv

    flags = [*([f"--max-restarts={args.max_restarts}"] if args.max_restarts else []),
             *([f"--world-size={args.world_size}"] if args.world_size else []),
             *(["--no-progress"] if args.no_progress else [])]
    return resume_argv(["meshtrain", "train"], args.config, overrides, out, flags)


def _main(args: argparse.Namespace, overrides: list[str], seen: dict) -> int:
    """``main`` inside its signal guard; ``seen`` tells it how far the run got."""
    from ..errors import MeshtrainError
    from . import interrupt
    from .config import load_config, to_toml, validate
    from .launch import launch
    from ..plan.run_check import profiled_plan_check, profiles_after
    from .preflight import plan_lines
    from .run_records import trained_words

    try:
        config = load_config(args.config, overrides + ([f"--out={args.out}"] if args.out else []))
        seen["config"] = config  # its out is fixed by launch (resolve_out), before any rank starts
        interrupt.set_resume(lambda: _resume_command(args, overrides, config.out))
        if args.print_config:
            validate(config)
            print(to_toml(config), end="")
            return 0
        seen["launched"] = True  # from here an Interrupted may have ended started ranks
        summary = launch(config, max_restarts=args.max_restarts, progress=not args.no_progress,
                         world=args.world_size)
    except MeshtrainError as exc:
        print(f"meshtrain train: error: {exc}", file=sys.stderr)
        return 2
    except ChildFailedError as exc:  # a worker process failed: say which and why, in one line
        if interrupt.received():  # a worker the signal reached before its handler: the interrupt says it
            raise interrupt.Interrupted(interrupt.received()) from None
        from .run_records import failure_line

        # its traceback to RUN_DIR/logs/rank-R.log; the exit code named is the one this command ends with
        line, code = failure_line(exc, config.out, os.path.join(config.out, config.checkpoint.dir))
        print(f"meshtrain train: error: {line}", file=sys.stderr)
        return code
    seen.pop("launched")
    seen["done"] = True
    if summary.get("preempted"):  # SIGINT / SIGTERM: every rank stopped at a step boundary with its checkpoint
        signum = interrupt.received() or summary["signum"]  # the launcher's own signal, else the ranks'
        line = interrupt.stopped_line(summary, signum, interrupt.resume_command(), config.elastic.enabled)
        print(f"meshtrain train: {line}", file=sys.stderr)
        return interrupt.exit_code(signum)
    if profiles_after(config, summary):  # every rank has ended: time the blocks for the run's check
        print(f"# planner: timing the model's blocks at the run's shapes for its check "
              f"(train.plan_check = {config.train.plan_check!r})", flush=True)
        summary = profiled_plan_check(config, summary)
    plan_lines(summary)  # once: the timed prediction where there is one, else the ranks' cached one
    print(f"# trained {trained_words(summary)} of a {summary['params'] / 1e6:.1f}M-parameter model on "
          f"{summary['world_size']} ranks ({', '.join(f'{k}={v}' for k, v in summary['layout'].items())}) in "
          f"{summary['seconds']:.0f} s: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"{summary['tokens_per_s']:.0f} tokens/s")
    print(f"# wrote {summary['run_dir']}/metrics.jsonl, loss.png, summary.json, tensorboard/")
    return 0
