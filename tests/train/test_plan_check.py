"""Every run checks the planner: ``meshtrain train`` writes the planner's predicted step time and peak
memory for its own layout beside the measured ones in summary.json and its last log line, from the
host's cached calibration; without one (or when the planner cannot price the run) the prediction
is null with a reason, and training is never failed over it. ``train.plan_check`` chooses: a CPU
run's blocks timed after it ("profiled"; "auto" for long runs), the cached figures only, or none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.config.check import model_config
from meshtrain.plan import auto, host
from meshtrain.plan.architectures import from_llama_config
from meshtrain.plan.layout import parse_layout
from meshtrain.plan.step import predict
from meshtrain.train.config import load_config
from meshtrain.hardware import cached_cpu_peak
from meshtrain.plan.run_check import plan_check, step_summary

ARGS = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
        "--train.seq_len=32", "--train.warmup_steps=1", "--train.steps=4", "--parallel.dp=2", "--parallel.tp=1",
        "--checkpoint.enabled=false", "--comm.transport=local"]
RUNTIME_MEMORY = 3e8  # the figure a calibration would have measured (a training run: seconds)


def _calibrate(cache: Path, monkeypatch) -> None:
    """A calibration of this host cached in ``cache``: the peak and bandwidth measured (fast), the
    runtime memory stored as measured. The session's tokenizer and token caches are shared (the
    calibration is this test's own)."""
    import torch

    from meshtrain.hardware import device_peak

    session = Path(os.environ["MESHTRAIN_CACHE_DIR"])
    cache.mkdir()
    for sub in ("tokenizers", "tokens"):
        (session / sub).mkdir(exist_ok=True)
        (cache / sub).symlink_to(session / sub)
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(cache))
    device_peak(torch.device("cpu"))
    host.measure_bandwidth(repeats=3)
    host._store("runtime_memory.json", host._runtime_key(), RUNTIME_MEMORY)


def test_a_run_writes_the_plans_prediction_beside_what_it_measured(tmp_path, monkeypatch, capsys):
    _calibrate(tmp_path / "cache", monkeypatch)
    out = tmp_path / "run"
    assert main(["train", f"--out={out}", "--no-progress", *ARGS]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = step_summary(records)
    assert (summary["measured_step_s"], summary["measured_peak_mem_bytes"]) == (got["step_s"], got["peak_mem_bytes"])
    # the reference: the planner on the same model, layout and cached figures (roofline: no profiling)
    cluster = host.cached_this_host()
    assert cluster is not None and cluster.base_memory_bytes == RUNTIME_MEMORY
    assert cluster.peak_flops == cached_cpu_peak() and not cluster.profile_compute
    arch = from_llama_config("test", model_config(load_config(None, ARGS), 512))
    want = predict(arch, cluster, parse_layout("dp=2", precision="fp32"), 4, 32)
    assert summary["predicted_step_s"] == pytest.approx(want.step_time) and want.step_time > 0
    assert summary["predicted_peak_mem_bytes"] == pytest.approx(want.memory.total) and want.memory.total > 0
    assert summary["prediction_reason"] is None and summary["prediction"]["layout"] == want.layout.label()
    last = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# planner")]
    assert last == [f"# planner: predicted {want.step_time:.4f} s/step, {want.memory.total / 2**20:.0f} MiB/rank "
                    f"(this-host, roofline, {want.layout.label()}); measured {got['step_s']:.4f} s/step, "
                    f"{got['peak_mem_bytes'] / 2**20:.0f} MiB peak"]


RECORDS = [{"step_s": s, "peak_mem_bytes": m} for s, m in ((0.5, 100), (0.3, 300), (0.2, 200), (0.4, 250))]


def _config():
    config = load_config(None, ARGS)
    return config, model_config(config, 512)


def test_without_a_cached_calibration_the_prediction_is_null_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "empty"))
    import torch

    from meshtrain import hardware

    def measuring(*args, **kwargs):
        raise AssertionError("the run's check of the planner measured something")

    # every measurement this-host could take: the matmul peak, the bandwidth, the runtime memory
    for mod, name in ((hardware, "measure_cpu_peak"), (host, "measure_bandwidth"), (host, "measure_runtime_memory")):
        monkeypatch.setattr(mod, name, measuring)
    check = plan_check(*_config(), torch.device("cpu"), RECORDS)
    assert check["predicted_step_s"] is None and check["predicted_peak_mem_bytes"] is None
    assert check["prediction_reason"].startswith("no host calibration cached")
    # the measured side is there all the same: the median and peak after two warm-up steps
    assert check["measured_step_s"] == pytest.approx((0.2 + 0.4) / 2) and check["measured_peak_mem_bytes"] == 300


def test_a_prediction_that_fails_is_a_reason_not_a_failed_run(tmp_path, monkeypatch):
    import torch

    def broken(*args, **kwargs):
        raise ZeroDivisionError("the planner divided by zero")

    monkeypatch.setattr(auto, "predict_run", broken)
    check = plan_check(*_config(), torch.device("cpu"), RECORDS)
    assert check["predicted_step_s"] is None and check["prediction_reason"] == "ZeroDivisionError: the planner " \
                                                                                  "divided by zero"
    # a layout the planner refuses names the planner's rule
    config, cfg = _config()
    monkeypatch.undo()
    _calibrate(tmp_path / "cache", monkeypatch)
    config.train.seq_len = 31  # sequence parallelism is off, but a layout of cp=2 needs seq % 4
    config.parallel.dp, config.parallel.cp = 1, 2
    check = plan_check(config, cfg, torch.device("cpu"), RECORDS)
    assert check["predicted_step_s"] is None
    assert "cp=2 needs --seq divisible by 2 x cp = 4" in check["prediction_reason"]


def test_a_gpu_run_is_priced_on_its_preset_and_an_unknown_gpu_is_a_reason(monkeypatch):
    import torch

    from meshtrain.plan.clusters import PRESETS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    config, cfg = _config()
    check = plan_check(config, cfg, torch.device("cuda"), RECORDS)
    want = predict(from_llama_config("test", cfg), PRESETS["h100"], parse_layout("dp=2", precision="fp32"), 4, 32)
    assert check["predicted_step_s"] == pytest.approx(want.step_time) and check["prediction"]["cluster"] == "h100"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-32GB")
    check = plan_check(config, cfg, torch.device("cuda"), RECORDS)
    assert check["predicted_step_s"] is None and "no cluster preset prices a 'Tesla V100" in check["prediction_reason"]


def test_profiled_check_times_the_blocks_after_the_run_and_keeps_the_cached_one(tmp_path, monkeypatch, capsys):
    """``train.plan_check = "profiled"``: once the ranks have ended, ``meshtrain train`` prices the run
    again with its blocks timed (here a stand-in for the timing, whose figures the planner's own tests
    check), replaces the prediction in summary.json and the last line, and keeps the cached one."""
    from types import SimpleNamespace

    _calibrate(tmp_path / "cache", monkeypatch)
    out = tmp_path / "run"
    real, calls = auto.predict_run, []

    def spy(config, model_cfg, device, profiled=False):
        calls.append((profiled, (out / "summary.json").exists()))
        pred, cluster = real(config, model_cfg, device)
        if not profiled:
            return pred, cluster
        timed = SimpleNamespace(step_time=pred.step_time * 7, memory=SimpleNamespace(total=pred.memory.total + 1),
                                layout=pred.layout)
        return timed, SimpleNamespace(name="this-host", profile_compute=True)

    monkeypatch.setattr(auto, "predict_run", spy)
    assert main(["train", f"--out={out}", "--no-progress", "--train.plan_check=profiled", *ARGS]) == 0
    # the cached check inside the run, then the timed one after summary.json was written by rank 0
    assert calls == [(False, False), (True, True)]
    summary = json.loads((out / "summary.json").read_text())
    cached = summary["prediction"]["cached"]
    assert cached["prediction"]["compute"] == "roofline" and summary["prediction"]["compute"] == "profiled"
    assert summary["predicted_step_s"] == pytest.approx(cached["predicted_step_s"] * 7)
    assert summary["predicted_peak_mem_bytes"] == cached["predicted_peak_mem_bytes"] + 1
    assert summary["prediction"]["step_ratio"] == pytest.approx(summary["predicted_step_s"] / summary["measured_step_s"])
    assert summary["prediction"]["profile_s"] >= 0 and summary["prediction_reason"] is None
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# planner: predicted")]
    assert [("roofline" in line, "profiled" in line) for line in lines] == [(False, True)]  # once: the timed one


def test_which_runs_are_profiled_after_and_off_predicts_nothing():
    import torch

    from meshtrain.plan.run_check import PROFILE_AFTER_S, profiles_after

    config, cfg = _config()
    done = {"device": "cpu", "measured_step_s": 0.1, "seconds": PROFILE_AFTER_S,
            "layout": {"dp": 2, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}}
    assert config.train.plan_check == "auto" and profiles_after(config, done)  # a long CPU run
    assert not profiles_after(config, dict(done, seconds=PROFILE_AFTER_S - 1))  # a short one: cached only
    assert not profiles_after(config, dict(done, device="cuda"))  # a GPU preset is analytic
    assert not profiles_after(config, dict(done, layout=dict(done["layout"], dp=1)))  # resized by elastic
    config.train.plan_check = "profiled"
    assert profiles_after(config, dict(done, seconds=1.0))
    config.train.plan_check = "cached"
    assert not profiles_after(config, done)
    config.train.plan_check = "off"
    check = plan_check(config, cfg, torch.device("cpu"), RECORDS)
    assert check["predicted_step_s"] is None and check["prediction_reason"] == "train.plan_check = 'off'"
    assert check["measured_step_s"] == pytest.approx(0.3)


def test_a_profiled_prediction_asks_for_the_measured_host_and_stops_the_profiling_copies(monkeypatch):
    asked, stopped = [], []

    def cluster_for(device, cached=False):
        asked.append(cached)
        raise host_error

    host_error = RuntimeError("no host here")
    monkeypatch.setattr(auto, "cluster_for", cluster_for)
    monkeypatch.setattr(auto, "stop_profiling", lambda: stopped.append(True))
    with pytest.raises(RuntimeError, match="no host here"):
        auto.predict_run(*_config(), "cpu", profiled=True)
    assert asked == [False] and stopped == [True]


def test_a_plan_check_that_is_not_a_mode_exits_2_before_any_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"--out={out}", "--no-progress", "--train.plan_check=sometimes", *ARGS]) == 2
    err = capsys.readouterr().err
    assert "train.plan_check = 'sometimes' is not one of auto, cached, profiled, off" in err
    assert not out.exists()


def test_a_profiled_check_that_fails_keeps_the_cached_one_and_says_why(tmp_path, monkeypatch):
    from meshtrain.plan.run_check import profiled_plan_check

    def broken(config, model_cfg, device, profiled=False):
        raise ZeroDivisionError("no blocks to time")

    monkeypatch.setattr(auto, "predict_run", broken)
    config, _ = _config()
    cached = {"cluster": "this-host", "compute": "roofline"}
    summary = {"run_dir": str(tmp_path), "vocab_size": 512, "measured_step_s": 0.3, "measured_peak_mem_bytes": 300,
               "predicted_step_s": 0.1, "predicted_peak_mem_bytes": 200, "prediction": cached}
    got = profiled_plan_check(config, dict(summary))
    assert got["prediction_profiled_reason"] == "ZeroDivisionError: no blocks to time"
    assert {k: got[k] for k in summary} == summary  # the cached check, untouched
    assert json.loads((tmp_path / "summary.json").read_text()) == got
