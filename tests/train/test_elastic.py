"""Elastic training, part one: the layout for the world a restart got (``layout_for_world``), a resume
on fewer ranks that trains every sample once with the same losses and records a ``world_change``
row, a SIGTERM that stops every rank after the same step with a checkpoint, and bad input that
stops with exit 2 before touching the checkpoint. Runs use ranks as threads (``comm.transport =
local``); ``meshtrain train --world-size N`` starts another number of ranks than the layout's, as
torchrun does after a membership change."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.train import elastic, elastic_launch
from meshtrain.train.config import load_config
from meshtrain.train.debug import describe_world_change, world_changes
from meshtrain.train.elastic import allowed_worlds, effective_config, layout_for_world
from meshtrain.train.loader import GlobalBatchLoader
from meshtrain.train.tokenizer import prepare_data

from .test_restart import _workers

STEPS = 6
CONFIG = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
          "--train.seq_len=32", "--train.warmup_steps=1", f"--train.steps={STEPS}", "--parallel.dp=2",
          "--parallel.tp=2", "--checkpoint.every=3", "--comm.transport=local"]
ARGS = [*CONFIG, "--no-progress"]


def _degrees(**kw: int) -> dict[str, int]:
    return {"dp": 1, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, **kw}


# -- layout_for_world ---------------------------------------------------------------------------


def test_fewer_ranks_shrink_dp_and_keep_the_rest():
    got, why = layout_for_world(_degrees(dp=4, tp=2), 4, global_batch=8)
    assert got == _degrees(dp=2, tp=2)
    assert "dp 4 -> 2" in why and "4 rows per dp rank" in why
    assert layout_for_world(_degrees(dp=4, tp=2), 16, global_batch=8)[0] == _degrees(dp=8, tp=2)  # grows back
    assert layout_for_world(_degrees(dp=4, tp=2), 8, global_batch=8)[0] == _degrees(dp=4, tp=2)  # unchanged


def test_carved_degrees_shrink_with_dp():
    # dp_replicate must divide dp; ep must divide dp_shard x cp: both drop to what still fits
    assert layout_for_world(_degrees(dp=4, dp_replicate=2), 2, 8)[0] == _degrees(dp=2, dp_replicate=2)
    assert layout_for_world(_degrees(dp=4, dp_replicate=2), 1, 8)[0] == _degrees(dp=1)
    assert layout_for_world(_degrees(dp=4, ep=4), 2, 8)[0] == _degrees(dp=2, ep=2)


def test_model_parallel_larger_than_the_world_is_an_error_naming_the_fix():
    d = _degrees(dp=1, tp=4, pp=2)
    with pytest.raises(ConfigError) as e:
        layout_for_world(d, 4, global_batch=8)
    msg = str(e.value)
    assert "tp x pp x cp = 4 x 2 x 1 = 8 is larger than the 4 ranks left" in msg
    assert "elastic.reshape_model_parallel = true" in msg
    # reference: worlds up to 2 x 8 that are a multiple of 8 whose dp divides the batch
    want = [w for w in range(1, 17) if w % 8 == 0 and 8 % (w // 8) == 0]
    assert f"world sizes that work: {want}" in msg


def test_a_global_batch_no_dp_divides_is_an_error_listing_the_worlds_that_work():
    with pytest.raises(ConfigError) as e:
        layout_for_world(_degrees(dp=4), 3, global_batch=4)
    msg = str(e.value)
    assert "train.global_batch = 4 is not divisible by dp x microbatches = 3 x 1" in msg
    want = [w for w in range(1, 9) if 4 % w == 0]
    assert want == allowed_worlds(_degrees(dp=4), 4, 1, 8) and f"world sizes that work: {want}" in msg
    assert "elastic.keep_global_batch = false" in msg
    # pipeline micro-batches count too: dp x microbatches must divide the batch
    with pytest.raises(ConfigError, match="dp x microbatches = 2 x 4"):
        layout_for_world(_degrees(dp=1, pp=2), 4, global_batch=4, microbatches=4)
    assert layout_for_world(_degrees(dp=1, pp=2), 4, global_batch=8, microbatches=4)[0] == _degrees(dp=2, pp=2)


def test_reshape_shrinks_cp_then_pp_then_tp_to_the_nearest_layout():
    d = _degrees(dp=1, tp=2, pp=2, cp=2)
    got, why = layout_for_world(d, 4, global_batch=12, reshape=True)
    assert got == _degrees(dp=1, tp=2, pp=2, cp=1) and "shrank cp" in why  # cp goes first
    # 6 ranks: no tp x pp x cp with tp = 2 and pp = 2 divides 6, so pp goes too; tp stays
    got, why = layout_for_world(d, 6, global_batch=12, reshape=True)
    assert got == _degrees(dp=3, tp=2) and "shrank cp, pp" in why
    # a rule of the caller's (the model's shape under tp, say) makes tp go as well; pp = 2 fits again
    def no_tp(degrees: dict[str, int]) -> None:
        if degrees["tp"] > 1:
            raise ConfigError("tp does not fit this model")

    assert layout_for_world(d, 6, global_batch=12, reshape=True, check=no_tp)[0] == _degrees(dp=3, pp=2)
    # every world the search accepts is a valid factorisation that divides the batch
    for world in range(1, 17):
        try:
            got, _ = layout_for_world(d, world, global_batch=12, reshape=True)
        except ConfigError:
            assert world not in allowed_worlds(d, 12, 1, 16, reshape=True)
            continue
        assert math.prod(got[k] for k in ("dp", "tp", "pp", "cp")) == world and 12 % got["dp"] == 0


def test_keep_global_batch_false_keeps_rows_per_rank_and_scales_the_lr():
    cfg = load_config(None, [*CONFIG, "--parallel.dp=4", "--parallel.tp=1", "--elastic.enabled=true",
                             "--elastic.keep_global_batch=false", "--train.lr=1e-3", "--train.min_lr=1e-4"])
    out, why = effective_config(cfg, 2)
    rows = 4 // 4  # the configured global batch / dp
    assert (out.parallel.dp, out.train.global_batch) == (2, rows * 2)
    assert out.train.lr == pytest.approx(1e-3 * 2 / 4) and out.train.min_lr == pytest.approx(1e-4 * 2 / 4)
    assert out.checkpoint.resume == "auto" and "keep_global_batch = false" in why
    assert cfg.parallel.dp == 4 and cfg.train.global_batch == 4  # the configured config is untouched
    off = load_config(None, CONFIG)
    assert effective_config(off, 2) == (off, None)  # disabled: the mesh refuses another world


def test_ranks_agree_to_stop_if_any_rank_was_asked():
    def rank(r: int, asked: set[int]) -> bool:
        return elastic.agree_to_stop(r in asked)

    assert comm.run_local(3, rank, {1}) == [True, True, True]
    assert comm.run_local(3, rank, set()) == [False, False, False]


def test_the_seconds_of_a_change_come_from_the_stop_marks_and_the_old_worlds_steps():
    from meshtrain.train.elastic_world import change_seconds, stopped_by

    stops = [{"step": 5, "step_end": 100.0, "stopped": 103.5, "why": "b"},
             {"step": 5, "step_end": 100.2, "stopped": 103.0, "why": "a: the first to stop"}]
    # step 5 ran twice (an earlier replay): its last run counts; steps 6 and 7 were not logged
    rows = [{"step": s, "step_s": 0.5} for s in range(1, 6)] + [{"event": "restart"}, {"step": 5, "step_s": 0.75}]
    secs, replayed = change_seconds(stops, 4, rows, started=110.0, load_start=112.0, load_end=112.25)
    assert replayed == 1 and stopped_by(stops) == "a: the first to stop"
    want = {"detect": 103.0 - 100.2, "rendezvous": 110.0 - 103.0, "setup": 2.0, "reshard": 0.25, "replay": 0.75}
    assert secs == pytest.approx({**want, "total": sum(want.values())})
    later = [{**m, "step": 7} for m in stops]  # the old world went 2 steps past its last logged one
    secs, replayed = change_seconds(later, 4, rows, 110.0, 112.0, 112.25)
    assert replayed == 3 and secs["replay"] == pytest.approx(0.75 + 2 * 0.5)  # the median step for the 2 unlogged
    secs, replayed = change_seconds([], 4, rows, 110.0, 112.0, 112.25)  # no marks: a resume by hand
    assert (secs["detect"], secs["rendezvous"], replayed) == (None, None, 1)


# -- runs ---------------------------------------------------------------------------------------


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steps(run: Path) -> list[dict]:
    return [r for r in _rows(run) if "event" not in r]


def _reference_samples(steps: int = STEPS) -> list[list[int]]:
    """The sample ids of every step, from the loader itself (independent of any layout)."""
    cfg = load_config(None, CONFIG)
    _, _, tokens = prepare_data(cfg.data)
    loader = GlobalBatchLoader(tokens, cfg.train.seq_len, cfg.train.global_batch, seed=cfg.train.seed)
    return [loader.next_ids() for _ in range(steps)]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Path:
    """A dp=2 x tp=2 run of STEPS steps on 4 ranks, with checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("elastic") / "ref"
    assert main(["train", f"--out={out}", *ARGS]) == 0
    return out


def test_a_resume_on_half_the_ranks_trains_every_sample_once_with_the_same_losses(undisturbed, tmp_path, capsys):
    ref = _steps(undisturbed)
    assert [r["samples"] for r in ref] == _reference_samples()
    out = tmp_path / "shrunk"
    resume = undisturbed / "checkpoints" / "step-00000003"
    assert main(["train", f"--out={out}", *ARGS, "--elastic.enabled=true", "--world-size=2",
                 f"--checkpoint.resume={resume}"]) == 0
    assert capsys.readouterr().err.count("# elastic: layout dp=2 tp=2 -> dp=1 tp=2: 2 ranks instead") == 1
    rows = _rows(out)
    change = rows[0]
    assert change["event"] == "world_change" and change["step"] == 3
    assert (change["old_world"], change["new_world"]) == (4, 2)
    assert (change["old_layout"]["dp"], change["new_layout"]["dp"], change["new_layout"]["tp"]) == (2, 1, 2)
    secs = change["seconds"]
    assert set(secs) == {"detect", "rendezvous", "setup", "reshard", "replay", "total"} and secs["reshard"] > 0
    # a resume started by hand from another run's checkpoint: no stop marks, nothing replayed here
    assert secs["detect"] is None and secs["rendezvous"] is None and change["replayed_steps"] == 0
    assert secs["total"] == pytest.approx(secs["setup"] + secs["reshard"])
    got = rows[1:]
    assert [r["step"] for r in got] == [4, 5, 6]
    # every sample once over both parts: steps 1-3 at dp=2, 4-6 at dp=1 are the loader's order
    assert [r["samples"] for r in ref[:3] + got] == _reference_samples()
    for a, b in zip(ref[3:], got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    assert world_changes(out) == [change]
    capsys.readouterr()
    assert main(["debug", "elastic", str(out)]) == 0  # one line per change
    assert capsys.readouterr().out.splitlines() == [describe_world_change(change)]
    assert describe_world_change(change).startswith("after step 3: 4 -> 2 ranks, dp=2 tp=2 -> dp=1 tp=2 (")
    assert (out / "loss.png").is_file()


def test_sigterm_saves_at_a_step_boundary_and_the_resume_continues_with_the_next_step(undisturbed, tmp_path,
                                                                                     monkeypatch):
    from meshtrain.train import trainer

    step = trainer.measure_step

    def slow_step(*args, **kwargs):  # the signal lands mid-run however fast the machine
        time.sleep(0.2)
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "measure_step", slow_step)
    out = tmp_path / "term"
    args = ["train", f"--out={out}", *ARGS, "--elastic.enabled=true"]
    sent: list[int] = []

    def kill_after_the_first_step() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                logged = (out / "metrics.jsonl").is_file() and _steps(out)
            except ValueError:  # a line caught half-written
                logged = False
            if logged:
                os.kill(os.getpid(), signal.SIGTERM)
                sent.append(len(_steps(out)))
                return
            time.sleep(0.005)

    # a signal that lands after the run's own handler is gone must not end pytest
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        killer = threading.Thread(target=kill_after_the_first_step, daemon=True)
        killer.start()
        rc = main(args)
        killer.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sent, "the run logged no step within 120 s"
    assert rc == elastic.EXIT_PREEMPTED, "the run was not stopped by the SIGTERM"
    first = _steps(out)
    stop = first[-1]["step"]
    assert 1 <= stop < STEPS and [r["step"] for r in first] == list(range(1, stop + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{stop:08d}"

    monkeypatch.setattr(trainer, "measure_step", step)
    assert main(args) == 0  # resumes from the saved step (elastic: checkpoint.resume = "auto")
    # the same layout again: a restart row, timed from the stop marks the stopped ranks left
    (restart,) = [r for r in _rows(out) if r.get("event") == "restart"]
    assert (restart["step"], restart["replayed_steps"], restart["new_world"]) == (stop, 0, 4)
    assert restart["stopped_by"].startswith(f"SIGTERM: stopped after step {stop}")
    assert restart["seconds"]["detect"] >= 0 and restart["seconds"]["rendezvous"] >= 0, restart
    assert not list((out / "elastic").glob("stop-*"))  # the marks are used up
    rows = _steps(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # none skipped, none repeated
    assert [r["samples"] for r in rows] == _reference_samples()
    for a, b in zip(_steps(undisturbed), rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])


def test_a_crash_resumes_from_the_step_kept_in_memory_not_the_disk_checkpoint(undisturbed, tmp_path, monkeypatch):
    """Every rank fails in step 5, two steps after the disk checkpoint of step 3; the restart resumes
    from step 4, which every rank kept in memory (``elastic.memory_every = 1``, the default), trains
    steps 5 and 6 with the undisturbed run's samples and losses, and the finished run removes the
    replicas. (Ranks as threads: one host, so the local copy only; the peer copy across hosts is
    tests/hosts/test_elastic_hosts.py's.)"""
    from meshtrain.train import trainer

    shm = tmp_path / "shm"  # the run's /dev/shm: what a failed run leaves stays out of the real one
    shm.mkdir()
    monkeypatch.setenv("MESHTRAIN_REPLICA_DIR", str(shm))
    step, calls = trainer.measure_step, {}
    # every rank in step 5 before any fails: a rank that failed at once would abort the others, and
    # one slower out of step 4's all-reduce (a busy machine) would never start its copy of step 4
    all_in_step_5 = threading.Barrier(4)

    def fail_in_step_5(*args, **kwargs):
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1
        if calls[name] == 5:
            all_in_step_5.wait(timeout=60)
            raise RuntimeError("this rank's host died")
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "measure_step", fail_in_step_5)
    out = tmp_path / "crash"
    args = ["train", f"--out={out}", *ARGS, "--elastic.enabled=true"]
    with pytest.raises(RuntimeError, match="host died"):
        main(args)
    for t in threading.enumerate():  # the copy of step 4, in the background when step 5 failed
        if t.name == "meshtrain-replica":
            t.join()
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000003"]
    assert len(list(shm.glob("meshtrain-mem-*/*/step-00000004/rank-*"))) == 4

    monkeypatch.setattr(trainer, "measure_step", step)
    assert main(args) == 0
    (restart,) = [r for r in _rows(out) if r.get("event") == "restart"]
    assert (restart["from"], restart["step"], restart["replayed_steps"]) == ("memory", 4, 0), restart
    rows = _steps(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in rows] == _reference_samples()
    for a, b in zip(_steps(undisturbed), rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    assert list(shm.iterdir()) == []  # a finished run keeps no replica


def test_a_world_with_no_layout_exits_2_naming_the_fix_and_leaves_the_checkpoint(undisturbed, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(undisturbed, out)
    before = _tree_digest(out)
    rc = main(["train", f"--out={out}", *ARGS, "--elastic.enabled=true", "--world-size=1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "tp x pp x cp = 2 x 1 x 1 = 2 is larger than the 1 rank left" in err, err
    want = [w for w in range(1, 9) if w % 2 == 0 and 4 % (w // 2) == 0]  # tp = 2 kept, dp divides 4
    assert f"world sizes that work: {want}" in err and "elastic.reshape_model_parallel = true" in err
    assert _tree_digest(out) == before  # the checkpoint (and everything else) untouched
    # another number of ranks without elastic: the fix is to enable it
    rc = main(["train", f"--out={out}", *ARGS, "--world-size=2"])
    assert rc == 2 and "set elastic.enabled = true" in capsys.readouterr().err
    assert _tree_digest(out) == before


@pytest.mark.timeout(180)
def test_a_sigterm_to_one_worker_process_stops_every_rank_after_the_same_step(tmp_path):
    """Real processes: only one of the 4 workers gets SIGTERM; the all-reduced flag stops them all
    after one step, with the only checkpoint there (checkpoint.every = 0), and exit 143."""
    steps, out = 12, tmp_path / "procs"
    config = [a for a in ARGS if a != "--comm.transport=local"] + [f"--train.steps={steps}", "--checkpoint.every=0",
                                                                   "--elastic.enabled=true"]
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain.cli", "train", f"--out={out}", *config],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim, deadline = None, time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        if victim is None and (out / "metrics.jsonl").is_file() and _rows(out):
            workers = _workers(proc.pid)
            assert len(workers) == 4, f"expected the launcher's 4 workers, found {workers}"
            victim = workers[-1]
            os.kill(victim, signal.SIGTERM)
        time.sleep(0.01)
    log = proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    assert victim is not None, f"the run logged no step:\n{log[-3000:]}"
    assert proc.returncode == elastic.EXIT_PREEMPTED, log[-3000:]
    first = _steps(out)
    stop = first[-1]["step"]
    assert 1 <= stop < steps and [r["step"] for r in first] == list(range(1, stop + 1)), log[-3000:]
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == [f"step-{stop:08d}"]
    # the rest on threads: every step once, the loader's samples
    assert main(["train", f"--out={out}", *ARGS, f"--train.steps={steps}", "--checkpoint.every=0",
                 "--elastic.enabled=true"]) == 0
    rows = _steps(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["samples"] for r in rows] == _reference_samples(steps)


# -- meshtrain launch --nodes MIN:MAX -------------------------------------------------------------

ELASTIC_JOB = """[model]
preset = "test"

[train]
global_batch = 6

[parallel]
dp = 3
tp = 2

[checkpoint]
every = 2
"""


PP_JOB = ELASTIC_JOB.replace("dp = 3\ntp = 2", "dp = 2\ntp = 2\npp = 2\nmicrobatches = 2").replace("6", "8")
"""dp2 x tp2 x pp2: 8 ranks, 4 nodes of 2; tp x pp = 4 does not fit 1 node nor divide 3 nodes' 6 ranks."""


def _launch(tmp_path: Path, kind: str, *argv: str, config: str = ELASTIC_JOB) -> tuple[int, str]:
    """``meshtrain launch --emit KIND --device cpu --procs-per-node 2 ...``: (exit code, the file or '')."""
    (tmp_path / "job.toml").write_text(config)
    out = tmp_path / f"job.{kind}"
    rc = main(["launch", "--emit", kind, "--device", "cpu", "--procs-per-node", "2", "--config",
               str(tmp_path / "job.toml"), "--out", str(out), *argv])
    return rc, out.read_text() if out.exists() else ""


def _torchrun(argv: list[str]):
    from torch.distributed.run import get_args_parser

    assert argv[0] == "torchrun"
    return get_args_parser().parse_args(argv[1:])


def test_an_elastic_slurm_job_asks_for_min_to_max_nodes_and_survives_a_lost_one(tmp_path):
    import shlex

    rc, script = _launch(tmp_path, "slurm", "--nodes", "2:3", "--max-restarts", "5", "--rdzv-conf",
                         "last_call_timeout=5")
    assert rc == 0
    lines = script.replace("\\\n", " ").splitlines()
    assert "#SBATCH --nodes=2-3" in lines and "#SBATCH --no-kill" in lines
    assert any(x.startswith("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") for x in lines)
    (srun,) = [shlex.split(x) for x in lines if x.startswith("srun ")]
    assert srun[:3] == ["srun", "--cpus-per-task=16", "--kill-on-bad-exit=0"]
    a = _torchrun(srun[3:])
    conf = dict(kv.split("=") for kv in a.rdzv_conf.split(","))
    assert (a.nnodes, a.max_restarts, a.rdzv_backend) == ("2:3", 5, "c10d")
    assert conf == {**{k: str(v) for k, v in elastic_launch.RDZV_CONF.items()}, "last_call_timeout": "5"}
    args = a.training_script_args
    assert args[:2] == ["--config", str((tmp_path / "job.toml").resolve())] and args[2] == "--out"
    assert load_config(args[1], args[4:]).elastic.enabled  # what each worker loads
    # a fixed job is as before: no elastic flag anywhere
    rc, fixed = _launch(tmp_path, "slurm", "--nodes", "3")
    assert rc == 0 and "--nnodes $SLURM_NNODES" in fixed
    assert not [w for w in ("--elastic.enabled", "--no-kill", "--max-restarts", "TORCH_DISABLE") if w in fixed]


def test_an_elastic_pytorchjob_has_the_operators_elastic_policy_and_workers_only(tmp_path):
    import yaml

    from .test_launch_emit import pytorchjob_schema_errors

    rc, text = _launch(tmp_path, "k8s", "--nodes", "2:3", "--pvc", "runs")
    assert rc == 0
    _, job = yaml.safe_load_all(text)
    spec = job["spec"]
    assert spec["pytorchReplicaSpecs"].keys() == {"Worker"} and spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    policy = spec["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["rdzvBackend"]) == (2, 3, "c10d")
    assert policy["maxRestarts"] == elastic_launch.DEFAULT_MAX_RESTARTS
    conf = {c["key"]: c["value"] for c in policy["rdzvConf"]}
    assert conf == {k: str(v) for k, v in elastic_launch.RDZV_CONF.items()}
    assert pytorchjob_schema_errors(job) == []
    (c,) = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in c["env"]
    # the operator sets PET_RDZV_ENDPOINT to worker 0's service and the Workers' pytorchjob-port
    argv = [a.replace("$(PET_RDZV_ENDPOINT)", "meshtrain-job-worker-0:29500") for a in c["command"]]
    a = _torchrun(argv)
    assert (a.nnodes, a.rdzv_endpoint, a.rdzv_backend, a.nproc_per_node) == ("2:3", "meshtrain-job-worker-0:29500",
                                                                             "c10d", "2")
    assert "--elastic.enabled=true" in a.training_script_args


@pytest.mark.parametrize("argv, config, message", [
    (["--nodes", "3:2"], ELASTIC_JOB, "--nodes 3:2: MIN 3 is larger than MAX 2"),
    (["--nodes", "two"], ELASTIC_JOB, "--nodes 'two' is not a node count N or a range MIN:MAX"),
    (["--nodes", "3", "--max-restarts", "3"], ELASTIC_JOB, "--max-restarts and --rdzv-conf apply to an elastic job"),
    (["--nodes", "2:3", "--rdzv-conf", "last_call_timeout"], ELASTIC_JOB, "'last_call_timeout' is not KEY=VALUE"),
    # tp x pp x cp = 4 neither fits 1 node of 2 ranks nor divides the 6 of 3 nodes: the first is explained
    (["--nodes", "1:4"], PP_JOB,
     "lets the job go on with 1 node(s) = 2 ranks, but elastic: no layout for the 2 ranks this run got (configured "
     "dp=2 tp=2 pp=2 on 8): tp x pp x cp = 2 x 2 x 1 = 4 is larger than the 2 ranks left"),
    (["--nodes", "1:4"], PP_JOB, "(node counts without a layout: [1, 3])"),
    # a global batch of 3 on dp 3: with 2 nodes dp would be 2, which does not divide it
    (["--nodes", "2:3"], ELASTIC_JOB.replace("global_batch = 6", "global_batch = 3"),
     "train.global_batch = 3 is not divisible by dp x microbatches = 2 x 1"),
])
def test_an_elastic_job_that_cannot_go_on_is_not_written(tmp_path, capsys, argv, config, message):
    for kind in ("slurm", "k8s"):
        rc, text = _launch(tmp_path, kind, *argv, config=config)
        err = capsys.readouterr().err
        assert rc == 2 and text == "" and message in err and err.startswith("meshtrain launch: error: "), err


def test_a_min_too_low_for_the_layout_is_named_with_the_min_that_works():
    cfg = load_config(None, ["--model.preset=test", "--parallel.dp=3", "--parallel.tp=2", "--train.global_batch=6"])
    with pytest.raises(ConfigError) as e:  # 1 node of 1 rank cannot hold tp = 2; 2 and 3 nodes can
        elastic_launch.check_node_counts(cfg, 1, 3, 1, "job.toml")
    assert "with 1 node(s) = 1 ranks, but" in str(e.value) and str(e.value).endswith("[1]); or use --nodes 2:3")
    elastic_launch.check_node_counts(cfg, 2, 3, 1, "job.toml")  # no error


def test_the_survivors_of_a_lost_host_are_told_the_fix_for_fewer_hosts_than_min():
    """torchrun itself says only RendezvousTimeoutError, join_timeout after the loss: each survivor
    host's local rank 0 says at the loss what happens and what to do if fewer than MIN remain."""
    from meshtrain.train.elastic_world import rendezvous_hint

    env = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "0", "TORCHELASTIC_MAX_RESTARTS": "3"}
    hint = rendezvous_hint(True, env)
    assert hint is not None and "--nnodes MIN" in hint and "RendezvousTimeoutError" in hint and "lower MIN" in hint
    assert rendezvous_hint(False, env) is None  # not elastic: the run stops
    assert rendezvous_hint(True, {**env, "LOCAL_RANK": "1"}) is None  # once per host
    assert rendezvous_hint(True, {**env, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restart to come
    assert rendezvous_hint(True, {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}) is None
