"""``meshtrain train`` end to end on small settings: metrics and plots are written, the loss
falls, every layout gives the one-process losses, bad input exits 2 with the reason."""

from __future__ import annotations

import json
import os
import math
import threading

import pytest

from meshtrain.cli import main
from meshtrain.train.config import TrainSection
from meshtrain.train.trainer import lr_at

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--train.warmup_steps=2", "--no-progress"]


def _run(tmp_path, name: str, *extra: str, steps: int = 6, transport: str = "local") -> list[dict]:
    out = tmp_path / name
    rc = main(["train", f"--out={out}", f"--train.steps={steps}", f"--comm.transport={transport}", *SMALL, *extra])
    assert rc == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule_is_linear_warmup_then_cosine():
    t = TrainSection(steps=20, warmup_steps=4, lr=1.0, min_lr=0.1)
    assert [lr_at(s, t) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    for s in (5, 12, 20):
        want = 0.1 + 0.45 * (1 + math.cos(math.pi * (s - 4) / 16))
        assert lr_at(s, t) == pytest.approx(want)
    assert lr_at(20, t) == pytest.approx(0.1)


def test_run_writes_metrics_plot_and_summary_and_the_loss_falls(tmp_path, capsys):
    rows = _run(tmp_path, "run", "--parallel.dp=2", "--parallel.tp=2", steps=12)
    assert [r["step"] for r in rows] == list(range(1, 13))
    keys = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_s", "compute_s", "samples"}
    assert keys <= rows[0].keys()
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.3
    assert all(0 < r["mfu"] < 1 and len(r["samples"]) == 4 for r in rows)
    run = tmp_path / "run"
    assert (run / "loss.png").stat().st_size > 0 and (run / "config.toml").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000012"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] == rows[-1]["loss"] and summary["layout"]["tp"] == 2
    assert "loss" in capsys.readouterr().out


def test_every_layout_trains_to_the_same_losses(tmp_path):
    """Warmup, cosine LR, clipping and AdamW through the whole trainer: one rank vs four layouts."""
    ref = _run(tmp_path, "one", "--parallel.dp=1", "--parallel.tp=1")
    for i, layout in enumerate([["--parallel.dp=2", "--parallel.tp=2"],
                                ["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=2", "--parallel.microbatches=2"],
                                ["--parallel.dp=1", "--parallel.tp=1", "--parallel.cp=2", "--parallel.zero_stage=1"],
                                # HSDP: 2 replicas of dp2 ZeRO-2 shards
                                ["--parallel.dp=4", "--parallel.dp_replicate=2", "--parallel.tp=1",
                                 "--parallel.zero_stage=2"]]):
        got = _run(tmp_path, f"l{i}", *layout)
        for a, b in zip(got, ref, strict=True):
            assert a["samples"] == b["samples"]
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"]


@pytest.mark.timeout(300)
def test_processes_resume_a_dp2xtp2_checkpoint_as_pp2xdp2_zero3(tmp_path):
    """Real processes (elastic launcher, shm) resume the default dp2 x tp2 layout's step-2
    checkpoint as pp2 x dp2 with ZeRO-3, within 1e-5 of the run that never stopped, with the same
    samples. (The default layout itself runs in processes in test_restart.py.)"""
    threads = _run(tmp_path, "threads", "--parallel.dp=2", "--parallel.tp=2", "--checkpoint.every=2", steps=4)
    ckpt = tmp_path / "threads" / "checkpoints" / "step-00000002"
    resumed = _run(tmp_path, "resumed", "--parallel.dp=2", "--parallel.tp=1", "--parallel.pp=2",
                   "--parallel.microbatches=2", "--parallel.zero_stage=3", f"--checkpoint.resume={ckpt}", steps=4,
                   transport="auto")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["samples"] for r in resumed] == [r["samples"] for r in threads[2:]]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in threads[2:]], rel=1e-5)
    # 4 worker processes share the cores, one intra-op thread per core between them (as torchrun)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    omp = os.environ.get("OMP_NUM_THREADS")
    assert summary["intra_op_threads"] == (int(omp) if omp else max(1, (os.cpu_count() or 1) // 4))


def test_print_config_and_bad_keys(tmp_path, capsys):
    assert main(["train", "--print-config", "--train.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "[train]" in out and "lr = 0.01" in out
    assert main(["train", "--train.lrr=0.1", f"--out={tmp_path / 'x'}"]) == 2
    assert "did you mean 'train.lr'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["train", "--parallel.tp=3", "--model.preset=test", f"--out={tmp_path / 'y'}"]) == 2
    assert "tp" in capsys.readouterr().err and not (tmp_path / "y").exists()
    assert main(["train", "--train.steps=abc", f"--out={tmp_path / 'z'}"]) == 2
    assert "train.steps" in capsys.readouterr().err and not (tmp_path / "z").exists()


def test_resume_same_layout_is_bitwise_and_other_layout_within_1e5(tmp_path):
    """A run that lost everything after its step-3 checkpoint resumes ("auto": its own latest) with
    the samples and the bitwise losses of the run that never stopped; another layout resumes from
    the same checkpoint within 1e-5."""
    import shutil

    dp2tp2 = ["--parallel.dp=2", "--parallel.tp=2"]
    full = _run(tmp_path, "full", *dp2tp2, "--checkpoint.every=3")
    half = tmp_path / "half"  # the same run, killed after step 3's checkpoint
    shutil.copytree(tmp_path / "full" / "checkpoints", half / "checkpoints")
    shutil.rmtree(half / "checkpoints" / "step-00000006")
    (half / "checkpoints" / "latest").write_text("step-00000003")
    resumed = _run(tmp_path, "half", *dp2tp2, "--checkpoint.resume=auto")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]  # bitwise
    assert [r["samples"] for r in resumed] == [r["samples"] for r in full[3:]]
    other = _run(tmp_path, "other", "--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=2",
                 "--parallel.microbatches=2", "--parallel.zero_stage=1",
                 f"--checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step-00000003'}")
    assert [r["step"] for r in other] == [4, 5, 6]
    for a, b in zip(other, full[3:]):
        assert a["samples"] == b["samples"] and abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]


def test_a_failing_worker_process_is_named_in_one_line(tmp_path, capsys):
    rc = main(["train", f"--out={tmp_path / 'r'}", "--train.steps=2", "--comm.transport=auto", "--parallel.dp=2",
               "--parallel.tp=1", f"--checkpoint.resume={tmp_path / 'nowhere'}", *SMALL])
    assert rc == 2
    err = capsys.readouterr().err
    assert "meshtrain train: error: worker rank" in err and "CheckpointError: no checkpoint at" in err


def test_async_save_overlaps_training_and_its_checkpoints_resume_bitwise(tmp_path, monkeypatch):
    """With checkpoint.async_save the shard files are written in the background from a snapshot:
    training is unchanged, and resuming the step-2 checkpoint (written while steps 3.. ran and
    changed the parameters) continues bitwise."""
    import time

    from meshtrain.train import checkpoint

    sync = _run(tmp_path, "sync", "--parallel.dp=2", "--parallel.tp=2", "--checkpoint.every=2")
    real, during = checkpoint.write_rank_shard, []

    def slow_write(*args, **kwargs):  # the writer lags: training goes on meanwhile
        time.sleep(0.5)
        during.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_rank_shard", slow_write)
    asyn = _run(tmp_path, "async", "--parallel.dp=2", "--parallel.tp=2", "--checkpoint.every=2",
                "--checkpoint.async_save=true")
    assert [r["loss"] for r in asyn] == [r["loss"] for r in sync]
    assert during and set(during) == {"meshtrain-checkpoint"}  # written off the training thread
    root = tmp_path / "async" / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000004", "step-00000006"]
    assert (root / "latest").read_text().strip() == "step-00000006" and not list(root.glob("*.tmp"))
    resumed = _run(tmp_path, "resumed", "--parallel.dp=2", "--parallel.tp=2",
                   f"--checkpoint.resume={root / 'step-00000002'}")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in sync[2:]]


def test_restart_with_fewer_ranks_reshards_and_keeps_the_sample_order(tmp_path):
    """A dp2 x tp2 run (4 ranks) that dies after its step-2 checkpoint is restarted on 2 ranks
    (dp halved) in the same run directory: it reshards and goes on with the same global samples."""
    import shutil

    full = _run(tmp_path, "full", "--parallel.dp=2", "--parallel.tp=2", "--checkpoint.every=2", steps=4)
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000002")
    rows = _run(tmp_path, "run", "--parallel.dp=1", "--parallel.tp=2", "--checkpoint.resume=auto", steps=4)
    assert [r["step"] for r in rows] == [3, 4]
    assert [r["samples"] for r in rows] == [r["samples"] for r in full[2:]]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in full[2:]], rel=1e-5)


def test_a_mixture_of_experts_run_logs_its_balance_and_counts_active_flops(tmp_path):
    """moe-test at dp2 x ep2: every MoE layer's tokens per expert add up to the step's tokens times
    top-k, the min/max/CV are those of the counts, the balance plot is written, and MFU counts the
    parameters a token uses."""
    from meshtrain.models.llama import PRESETS, active_params, num_params, Llama
    from meshtrain.train.config import load_config, model_config

    args = ["--model.preset=moe-test", "--model.aux_loss_coef=0.01", "--model.bias_update_rate=0.001",
            "--parallel.dp=2", "--parallel.tp=1", "--parallel.ep=2"]
    rows = _run(tmp_path, "moe", *args, steps=3)
    k = PRESETS["moe-test"].moe_top_k
    for r in rows:
        assert r["moe_layers"] == [1, 2, 3]  # layer 0 is dense
        for i, counts in enumerate(r["moe_tokens"]):
            assert sum(counts) == 4 * 32 * k
            mean = sum(counts) / len(counts)
            cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean
            assert r["moe_tokens_cv"][i] == pytest.approx(cv)
            assert (r["moe_tokens_min"][i], r["moe_tokens_max"][i]) == (min(counts), max(counts))
        assert r["moe_dropped"] == [0.0, 0.0, 0.0] and r["moe_aux_loss"] > 0
    run = tmp_path / "moe"
    assert (run / "load_balance.png").stat().st_size > 0
    summary = json.loads((run / "summary.json").read_text())
    cfg = model_config(load_config(None, [a for a in SMALL + args if a != "--no-progress"]), 512)
    import torch
    with torch.device("meta"):
        assert summary["params"] == num_params(Llama(cfg))
    assert summary["active_params"] == active_params(cfg) < summary["params"]
