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
from meshtrain.train import elastic
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
    assert set(change["seconds"]) == {"start_to_resume", "setup", "load"} and change["seconds"]["load"] > 0
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
    rows = _steps(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # none skipped, none repeated
    assert [r["samples"] for r in rows] == _reference_samples()
    for a, b in zip(_steps(undisturbed), rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])


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
