"""``meshtrain`` command line: thin dispatch to the subcommands' own modules."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``meshtrain`` command."""
    parser = argparse.ArgumentParser(prog="meshtrain", description="distributed training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a Llama (dense or mixture-of-experts) on a (dp, pp, cp, tp, ep) "
                                         "layout; --section.key=value overrides")
    from .train import cli as train_cli

    train_cli.add_arguments(train)
    from .train import hf_cli

    hf_cli.add_export_arguments(sub.add_parser("export", help="a checkpoint -> a Hugging Face directory "
                                               "(LlamaForCausalLM, or the MoE class that computes it)"))
    hf_cli.add_import_arguments(sub.add_parser("import", help="train (any layout) from a local Hugging Face Llama or "
                                               "MoE directory; --section.key=value overrides"))
    hf_cli.add_generate_arguments(sub.add_parser("generate", help="sample text from a checkpoint"))
    bench = sub.add_parser("bench", help="benchmarks that compare with a peer in the same run")
    bsub = bench.add_subparsers(dest="bench", required=True)
    comm = bsub.add_parser("comm", help="collective bandwidth/latency table (nccl-tests format)")
    from .bench import comm_cli

    comm_cli.add_arguments(comm)
    train = bsub.add_parser("train", help="DataParallel / ZeRO-3 tokens/s and memory vs torch DDP / FSDP2")
    from .bench import train_cli

    train_cli.add_arguments(train)
    pipe = bsub.add_parser("pipeline", help="pipeline schedules: measured bubble vs theory, activation memory")
    from .bench import pipeline_cli

    pipeline_cli.add_arguments(pipe)
    ckpt = bsub.add_parser("checkpoint", help="peak RSS of a ZeRO save and load vs training steps")
    from .bench import checkpoint as bench_checkpoint

    bench_checkpoint.add_arguments(ckpt)
    loop = bsub.add_parser("loop", help="meshtrain train on one rank vs a plain PyTorch loop: tokens/s, MFU")
    from .bench import loop as bench_loop

    bench_loop.add_arguments(loop)
    compat = bsub.add_parser("compat", help="one torch.distributed-style loop under torch.distributed and meshtrain.comm")
    from .bench import compat as bench_compat

    bench_compat.add_arguments(compat)
    moe = bsub.add_parser("moe", help="mixture of experts: all-to-all vs gloo, grouped experts vs a loop, ep2 vs ep1")
    from .bench import moe_cli

    moe_cli.add_arguments(moe)
    from .plan import cli as plan_cli

    plan_cli.add_arguments(sub.add_parser("plan", help="predict step time, memory and MFU of layouts; --search ranks them"))
    from .plan import bench as plan_bench

    plan_bench.add_arguments(bsub.add_parser("plan", help="the planner's predicted step time and memory vs "
                                             "meshtrain train on this host"))
    launch = sub.add_parser("launch", help="write a Slurm sbatch script or a Kubeflow PyTorchJob for a config")
    from .train import launch_emit

    launch_emit.add_arguments(launch)
    debug = sub.add_parser("debug", help="post-mortems: which rank stopped where")
    dsub = debug.add_subparsers(dest="debug", required=True)
    from .train import debug as debug_mod

    debug_mod.add_arguments(dsub.add_parser("hang", help="read RUN_DIR/flight/ and name the ranks that stopped"))
    debug_mod.add_elastic_arguments(dsub.add_parser("elastic", help="list RUN_DIR's world changes (elastic runs)"))
    viz = sub.add_parser("viz", help="pictures: pipeline schedules as Gantt charts")
    vsub = viz.add_subparsers(dest="viz", required=True)
    schedule = vsub.add_parser("schedule", help="draw a simulated pipeline schedule or a measured trace as a PNG")
    from .viz import schedule as viz_schedule

    viz_schedule.add_arguments(schedule)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshtrain`` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        from .train import cli as train_cli

        return train_cli.main(args, extra)
    if args.command == "import":
        from .train import hf_cli

        return hf_cli.main_import(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench" and args.bench == "comm":
        from .bench import comm_cli

        return comm_cli.main(args)
    if args.command == "bench" and args.bench == "train":
        from .bench import train_cli

        return train_cli.main(args)
    if args.command == "bench" and args.bench == "checkpoint":
        from .bench import checkpoint as bench_checkpoint

        return bench_checkpoint.main(args)
    if args.command == "bench" and args.bench == "compat":
        from .bench import compat as bench_compat

        return bench_compat.main(args)
    if args.command == "bench" and args.bench == "loop":
        from .bench import loop as bench_loop

        return bench_loop.main(args)
    if args.command == "bench" and args.bench == "moe":
        from .bench import moe_cli

        return moe_cli.main(args)
    if args.command == "bench" and args.bench == "pipeline":
        from .bench import pipeline_cli

        return pipeline_cli.main(args)
    if args.command in ("export", "generate"):
        from .train import hf_cli

        return hf_cli.main_export(args) if args.command == "export" else hf_cli.main_generate(args)
    if args.command == "bench" and args.bench == "plan":
        from .plan import bench as plan_bench

        return plan_bench.main(args)
    if args.command == "plan":
        from .plan import cli as plan_cli

        return plan_cli.main(args)
    if args.command == "launch":
        from .train import launch_emit

        return launch_emit.main(args)
    if args.command == "debug":
        from .train import debug as debug_mod

        return debug_mod.main(args)
    if args.command == "viz" and args.viz == "schedule":
        from .viz import schedule as viz_schedule

        return viz_schedule.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
