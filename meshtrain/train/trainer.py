"""The training loop every rank runs: data -> ParallelModel -> AdamW with warmup + cosine, global
gradient clipping, metrics on rank 0, the loss plot and a summary at the end.

It needs an initialised communicator (processes: ``launch.py``; threads: ``comm.run_local``) whose
world size is dp·pp·cp·tp. Every rank reads the same global batch; the model takes its share.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .. import comm
from ..config.dims import degrees_of, world_size_of
from ..errors import CollectiveError, ConfigError, MeshtrainError
from ..files import write_json_atomic
from ..hardware import device_peak, peak_memory_bytes
from ..mesh import Mesh
from ..models.flops import flops_per_token
from ..models.llama import Llama, active_params, num_params
from ..parallel.parallel_model import ParallelModel
from ..parallel.precision import DynamicLossScaler
from . import elastic, elastic_world, interrupt, memory_replica, preflight, run_dir as run_files, run_records
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .checkpoint_io import step_dir_name
from .checkpoint_async import CheckpointSaver
from .config import Config, TrainSection, model_config, parallel_config, to_dict, to_toml
from .config_check import check_algorithm
from .debug import dump_flight_record
from .loader import GlobalBatchLoader
from .moe_metrics import CollapseWatch, moe_record, plot_load_balance
from .metrics import MetricsLogger, line_every, plot_loss, read_rows
from .step import StepResult, apply_step, measure_step
from .tokenizer import prepare_data


class TrainingDiverged(MeshtrainError):
    """The loss became NaN or infinite."""


def lr_at(step: int, t: TrainSection) -> float:
    """Learning rate of 1-based ``step``: linear warmup to ``lr`` over ``warmup_steps`` (at most
    ``steps``: a longer warmup is clamped to the run, as the launcher's note says), then a cosine
    decay to ``min_lr`` at ``steps``."""
    warmup = min(t.warmup_steps, t.steps)
    if warmup and step <= warmup:
        return t.lr * step / warmup
    span = max(t.steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    """``auto``: this rank's CUDA device if CUDA is available, else the CPU. This rank's CUDA
    device is its rank modulo the visible devices: the communicator's rank where one is bound
    (ranks as threads take the GPUs in turn), else ``LOCAL_RANK`` (torchrun), else 0; so a tool
    that runs outside any communicator (``meshtrain bench loop``) may call it too."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device = 'cuda' but this process sees no CUDA device (torch {torch.__version__}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use "
                          f"train.device = 'cpu', or 'auto' to take a GPU only where there is one")
    if name == "cuda":
        rank = comm.get_rank() if comm.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device(name)


def train(config: Config, progress: bool = True, report: bool = False) -> dict[str, Any]:
    """Train as configured; returns the run's summary (the same on every rank). ``report``: rank 0
    prints the preflight notes (under torchrun, where no launcher did)."""
    check_same_config(config)  # first: ranks that differ in comm.algorithm get this error, not a mismatch
    c = comm.current()
    previous = c.preferred_algorithm
    c.preferred_algorithm = preferred_algorithm(config, c.transport.kind)
    try:
        return _train(config, progress, report)
    finally:  # a thread's communicator may outlive the run (comm.run_local)
        c.preferred_algorithm = previous


def preferred_algorithm(config: Config, transport_kind: str) -> str | None:
    """What ``algorithm="auto"`` should resolve to for this run (``comm.algorithm``; None: the
    cost model). Raises ``ConfigError`` when the name runs none of training's collectives on the
    transport the run got (``validate`` cannot know it when ``comm.transport = "auto"``)."""
    name = config.comm.algorithm
    check_algorithm(name, [transport_kind], f"the {transport_kind} transport this run got "
                    f"(comm.transport = {config.comm.transport!r})")
    return None if name == "auto" else name


def _train(config: Config, progress: bool, report: bool) -> dict[str, Any]:
    entered = time.perf_counter()
    configured = config
    corpus, tokenizer, tokens = prepare_data(config.data)
    if report and comm.get_rank() == 0:
        preflight.torchrun_report(config, corpus, tokenizer, tokens, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # elastic: the layout for the ranks this run got (the configured one when they match)
    config, reshaped = elastic.effective_config(config, comm.get_world_size(), tokenizer.vocab_size)
    if reshaped and comm.get_rank() == 0:
        print(f"# elastic: layout {elastic.layout_label(degrees_of(configured.parallel))} -> "
              f"{elastic.layout_label(degrees_of(config.parallel))}: {reshaped}", file=sys.stderr, flush=True)
    t, p = config.train, config.parallel
    torch.manual_seed(t.seed)
    device = resolve_device(t.device)
    cfg = model_config(config, tokenizer.vocab_size)
    try:
        mesh = Mesh(**degrees_of(p))
    except ConfigError as exc:
        if config.elastic.enabled or world_size_of(degrees_of(p)) == comm.get_world_size():
            raise
        raise ConfigError(f"{exc}; or set elastic.enabled = true to choose the layout for the "
                          f"{comm.get_world_size()} ranks this run got") from None
    model = ParallelModel(cfg, mesh, parallel_config(config), seed=t.seed, device=device)
    # fused AdamW on a GPU: one kernel, and its step counts stay on the device (no host reads)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = model.build_optimizer(torch.optim.AdamW, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                **fused)
    loader = GlobalBatchLoader(tokens, t.seq_len, t.global_batch, seed=t.seed)
    # fp16: dynamic loss scaling (its state is the same on every rank, so it rides in extra)
    scaler = DynamicLossScaler(t.loss_scale_init, t.loss_scale_growth_interval) if t.precision == "fp16" else None
    with torch.device("meta"):  # the whole model's size, whatever this rank holds
        full = Llama(cfg)
    n_params = num_params(full)
    # the embedding lookup does no matmul: MFU counts 6N over the other parameters (tied: the head's),
    # and of a mixture of experts only those a token uses (the router, shared and top-k experts)
    n_matmul = active_params(cfg) - (0 if cfg.tie_embeddings else full.tok_emb.weight.numel())
    tokens_per_step = t.global_batch * t.seq_len
    flops_step = flops_per_token(cfg, n_matmul, t.seq_len) * tokens_per_step
    # CPU ranks share a host; its peak was measured by the launcher (under torchrun: the first run)
    peak = device_peak(device, refresh=False) * (mesh.world_size if device.type == "cuda" else 1)

    rank0 = comm.get_rank() == 0
    run_dir = Path(config.out)
    described = run_files.describe(corpus, tokenizer, run_dir)  # in every checkpoint's extra, which copies the tokenizer
    ckpt_root = run_dir / config.checkpoint.dir
    replicas = memory_replica.start(config, model, device)  # elastic: the step state kept in host memory
    loading = time.perf_counter()
    start_step, saved = _resume(config, ckpt_root, model, opt, loader, scaler, replicas)
    resumed = time.perf_counter()
    resumed_from = run_files.resumed_checkpoint(config) if saved is not None else None
    elastic_world.begin(run_dir, start_step)
    logger, segment = None, 0  # segment: which of the run's segments this is (rank 0's count: keep_config)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        # as launched (elastic derives layouts from it); the previous segment's is kept in configs/
        segment = run_records.keep_config(run_dir, to_toml(configured))
        run_files.write_run_files(run_dir, tokenizer, described)  # the run's tokenizer and data, whatever the cache
        row = None
        if saved is not None and config.elastic.enabled:  # before the logger appends to metrics.jsonl
            row = _elastic_row(config, run_dir, saved, start_step, reshaped, entered, loading, resumed,
                               "memory" if replicas is not None and replicas.restored == start_step else "disk")
        if saved is not None:
            print(run_records.resume_line(resumed_from, start_step, elastic.layout_of_checkpoint(saved), degrees_of(p)),
                  file=sys.stderr, flush=True)
        logger = MetricsLogger(run_dir, t.steps, start_step, progress=progress,
                               print_every=line_every(t.steps, t.log_every, t.print_every))
        if row is not None:
            stops = row.pop("_stops")
            logger.event(row)
            elastic_world.clear_stops(run_dir, stops)
    comm.barrier()  # the run directory exists before anyone writes into it
    start, loss = time.perf_counter(), float("nan")
    watch = CollapseWatch()  # a mixture of experts: one line when an expert starves (rank 0)
    saver = CheckpointSaver(config.checkpoint.async_save)
    ck, saved_step, stopped, stop_signal = config.checkpoint, -1, 0, 0

    def extra(step: int) -> dict[str, Any]:
        return {"step": step, "loader": loader.state_dict(), "config": to_dict(config), "rng": torch.get_rng_state(),
                **({"loss_scaler": scaler.state_dict()} if scaler is not None else {}), **described}

    try:
        for step in range(start_step + 1, t.steps + 1):
            lr = lr_at(step, t)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = loader.next_batch()
            # SIGINT / SIGTERM (interrupt.py): the stop flag, all-reduced, rides this step's one host
            # read (elastic agrees on it at the step boundary below, with its replicas' step)
            flag = None if config.elastic.enabled else elastic.stop_flag(interrupt.requested_signal(), device)
            comm.reset_stats()
            t0 = time.perf_counter()
            res = measure_step(model, opt, batch.inputs.to(device, non_blocking=True),
                               batch.targets.to(device, non_blocking=True), t.grad_clip, scaler, flag)
            loss, norm = res.loss, res.grad_norm
            _check_finite(res, step, scaler, t, ckpt_root)  # before the step writes non-finite weights
            apply_step(opt, res, scaler)  # under fp16 an overflow on any rank skips it on all
            dt = time.perf_counter() - t0
            elastic_world.note_step(step)  # a stop mark says which step the world finished last, and when
            comm_s = sum(g["total"]["time_s"] for g in comm.stats().values())
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens_per_step / dt,
                      "mfu": flops_step / dt / peak, "peak_mem_bytes": peak_memory_bytes(device),
                      "step_s": dt, "comm_s": comm_s, "compute_s": max(dt - comm_s, 0.0),
                      "samples": batch.sample_ids}
            if scaler is not None:  # a skipped step's norm is NaN: null (JSON has no NaN)
                record.update(grad_norm=None if res.overflow else norm, loss_scale=res.loss_scale,
                              skipped=res.overflow, skipped_steps=scaler.skipped)
            if model.moe_stats is not None:
                record.update(moe_record(model.moe_stats))
                collapse = watch.update(record) if logger is not None else None
                if collapse:  # rank 0, once a run
                    print(collapse, file=sys.stderr, flush=True)
            if logger is not None and (step % t.log_every == 0 or step == t.steps):
                logger.log({**record, "segment": segment})  # a later segment's rows supersede (read_steps)
            if ck.enabled and ((ck.every and step % ck.every == 0) or step == t.steps):
                saver.save(str(ckpt_root), step, model, opt, keep=ck.keep, extra=extra(step))
                saved_step = step
            if step == t.steps:
                continue
            # one flag all-reduced per step, so every rank stops after the same one; under elastic the
            # same all-reduce tells every rank the newest step whose memory replicas all ranks kept
            stop, acked = res.stop, 0
            if config.elastic.enabled:
                done = replicas.wait() if replicas is not None else 0
                stop, acked = elastic.agree_at_boundary(interrupt.requested_signal(), done, device)
            if stop:
                saver.wait()  # an async save of this step commits here
                if ck.enabled and saved_step != step:  # even with checkpoint.every = 0
                    save_checkpoint(str(ckpt_root), step, model, opt, extra(step), ck.keep)
                    saved_step = step
                if replicas is not None:  # the checkpoint just saved holds what they hold
                    replicas.close()
                if config.elastic.enabled:
                    elastic_world.write_stop(run_dir, comm.get_rank(), comm.get_world_size(),
                                             f"{interrupt.signal_name(stop).split()[0]}: stopped after step {step} "
                                             f"with its checkpoint (a membership change, or preemption)")
                stopped, stop_signal = step, stop
                break
            if replicas is not None:
                replicas.snapshot(step, acked, opt, lambda: extra(step))
        saver.wait()  # an async save in flight is committed before the run ends
        if replicas is not None and not stopped:  # a finished run needs them no more, on any host
            replicas.close()
    except CollectiveError:
        # a hang or a desync: leave this rank's last collectives for `meshtrain debug hang RUN_DIR`
        dump_flight_record(run_dir, comm.get_rank())
        raise
    finally:
        if logger is not None:
            logger.close()
    if stopped:  # returned, not raised: a raising rank would abort peers still finishing the save
        return interrupt.stopped_summary(stopped, stop_signal, str(ckpt_root / step_dir_name(stopped))
                                         if saved_step == stopped else None, str(run_dir), t.steps)
    summary = {"steps": t.steps, "final_loss": loss, "params": n_params, "active_params": active_params(cfg),
               "world_size": mesh.world_size, "device": device.type, "vocab_size": cfg.vocab_size,
               "layout": degrees_of(p), "seconds": time.perf_counter() - start,
               "run_dir": str(run_dir), "intra_op_threads": torch.get_num_threads(),
               **run_records.segment_summary(start_step, t.steps, resumed_from, segment)}
    if scaler is not None:
        summary.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    if replicas is not None:  # what keeping the step state in host memory cost (this rank's)
        summary["memory_replicas"] = dict(replicas.stats)
    if logger is not None and logger.history:
        hist = logger.history
        summary.update(first_loss=hist[0]["loss"], tokens_per_s=sum(r["tokens_per_s"] for r in hist) / len(hist))
        from ..plan.run_check import plan_check  # plan sits above train: imported only here

        # every run checks the planner: its prediction for this layout beside what the run measured
        check = plan_check(config, cfg, device, hist)
        summary.update(check)
        whole, marks = run_records.whole_run(run_dir)  # every segment's steps, each once: the whole run
        plot_loss(whole, run_dir / "loss.png", marks=marks)
        plot_load_balance(whole, run_dir / "load_balance.png")
        write_json_atomic(run_dir / "summary.json", summary)  # its `# planner:` line is the launcher's, once
    return summary


def _elastic_row(config: Config, run_dir: Path, saved: dict[str, Any], step: int, reason: str | None,
                 entered: float, loading: float, resumed: float, source: str = "disk") -> dict[str, Any] | None:
    """The ``world_change`` row of an elastic resume under another layout than the checkpoint's, or
    a ``restart`` row of one under the same layout that follows a stop (stop marks) or replays
    steps; None for a plain resume. Its seconds are ``elastic_world.change_seconds``'; ``source``
    ("memory" or "disk") is where step ``step`` came from; ``_stops`` (the marks read, removed once
    the row is written) is for the caller to pop."""
    old = elastic.layout_of_checkpoint(saved)
    new = degrees_of(config.parallel)
    stops = elastic_world.read_stops(run_dir)
    rows = read_rows(run_dir / "metrics.jsonl")  # a line a killed rank 0 left half-written is skipped
    # wall clock: the stop marks come from other processes. A worker process counts from its own
    # start (imports and process group included); ranks as threads from the trainer's.
    wall = time.time() - time.perf_counter()
    started = elastic_world.process_start() if "TORCHELASTIC_RUN_ID" in os.environ else entered + wall
    seconds, replayed = elastic_world.change_seconds(stops, step, rows, started, loading + wall, resumed + wall)
    changed = old is not None and old != new
    if not changed and not stops and not replayed and source == "disk":
        return None
    if not changed:
        reason = "the same layout"
    row = elastic.world_change_row(step, old or new, new, reason, seconds,
                                   event="world_change" if changed else "restart",
                                   stopped_by=elastic_world.stopped_by(stops), replayed_steps=replayed,
                                   **{"from": source})
    row["_stops"] = stops
    return row


def _check_finite(res: StepResult, step: int, scaler: DynamicLossScaler | None, t: TrainSection,
                  ckpt_root: Path) -> None:
    """Raise ``TrainingDiverged`` for a non-finite loss or gradient norm. Under fp16 an overflowing
    gradient is the scaler's to handle (the step is skipped), unless the scale is already at its
    minimum: then the gradients themselves exceed fp16's range, as DeepSpeed concludes too."""
    if not math.isfinite(res.loss):  # the forward, which loss scaling does not touch
        raise TrainingDiverged(f"the loss became {res.loss} at step {step}; {_diverged_fix(t, ckpt_root)}")
    if scaler is not None and res.overflow:
        if scaler.scale <= scaler.min_scale:
            raise TrainingDiverged(f"the gradients overflowed float16 at step {step} with the loss scale already at "
                                   f"its minimum {scaler.min_scale}; use train.precision = 'bf16' (fp32's range), "
                                   f"or {_diverged_fix(t, ckpt_root)}")
        return
    if not math.isfinite(res.grad_norm):
        raise TrainingDiverged(f"the gradient norm became {res.grad_norm} at step {step}; "
                               f"{_diverged_fix(t, ckpt_root)}")


def _diverged_fix(t: TrainSection, ckpt_root: Path) -> str:
    """What to do after a divergence: the knobs, and the last good checkpoint (none of the bad step
    is written: the trainer stops before saving it)."""
    last = latest_checkpoint(str(ckpt_root))
    where = f"resume from the last good checkpoint {last} (--checkpoint.resume={last})" if last else \
        "no checkpoint was saved before it, so start again"
    return f"lower train.lr (now {t.lr}) or raise train.warmup_steps (now {t.warmup_steps}), and {where}"


def _config_hash(value: Any) -> float:
    """52 bits of a value's sha256, exact in a float64 (what the all-reduce below sums)."""
    return float(int(hashlib.sha256(repr(value).encode()).hexdigest()[:13], 16))


def check_same_config(config: Config) -> None:
    """Collective over the world: raise ``ConfigError`` on every rank unless all ranks were started
    with the same config, naming the ranks that differ from rank 0 and the keys that differ. Each
    rank contributes one hash per key (a world x keys table, summed: each row is one rank's)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    if world == 1:
        return
    d = to_dict(config)
    flat = {f"{s}.{k}": v for s, sec in d.items() if isinstance(sec, dict) for k, v in sec.items()}
    flat.update({k: v for k, v in d.items() if not isinstance(v, dict)})
    keys = sorted(flat)
    table = torch.zeros(world, len(keys), dtype=torch.float64)
    table[rank] = torch.tensor([_config_hash(flat[k]) for k in keys], dtype=torch.float64)
    comm.all_reduce(table)
    ranks = [r for r in range(world) if not torch.equal(table[r], table[0])]
    if ranks:
        differ = [k for i, k in enumerate(keys) if bool((table[:, i] != table[0, i]).any())]
        mine = ", ".join(f"{k} = {flat[k]!r}" for k in differ)
        raise ConfigError(f"rank(s) {ranks} were started with a different config than rank 0 (keys that differ: "
                          f"{', '.join(differ)}; rank {rank} has {mine}); start every rank with the same config "
                          f"file and --section.key overrides")


def _resume(config: Config, root: Path, model: ParallelModel, opt: Any, loader: GlobalBatchLoader,
            scaler: DynamicLossScaler | None, replicas: memory_replica.MemoryReplicas | None = None
            ) -> tuple[int, dict[str, Any] | None]:
    """Load the checkpoint ``checkpoint.resume`` names ("auto": this run's latest, if any) into the
    model, optimizer, loader and fp16 loss scaler (one saved without a scaler leaves it at its
    initial scale), under whatever layout this run has; returns its step (0: none) and its extra.
    With ``replicas`` and "auto", a newer step that survived in host memory is committed first
    (``MemoryReplicas.restore``), so "latest" is that one."""
    want = config.checkpoint.resume
    if replicas is not None:  # collective: every rank, whatever it resumes
        replicas.restore(root, config.checkpoint.keep, use=want == "auto")
    if not want:
        return 0, None
    path = latest_checkpoint(str(root)) if want == "auto" else want
    if path is None:
        return 0, None
    extra = load_checkpoint(path, model, opt)
    loader.load_state_dict(extra["loader"])
    torch.set_rng_state(extra["rng"])
    if scaler is not None and "loss_scaler" in extra:
        scaler.load_state_dict(extra["loss_scaler"])
    return int(extra["step"]), extra
