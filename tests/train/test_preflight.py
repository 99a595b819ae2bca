"""What ``meshtrain train`` checks and says before its ranks start (``meshtrain/train/preflight.py``),
and the notes during and after a run (issue 56, parts 7-9): each test fails on the code before and
passes after. Most call the pure functions; the CLI ones stop before any rank starts, and one runs
two steps as threads for the lines a finished run prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.errors import ConfigError, DataError
from meshtrain.train import preflight
from meshtrain.train.config import Config, DataSection, TrainSection, load_config, validate
from meshtrain.train.metrics import MetricsLogger, line_every
from meshtrain.train.moe_metrics import CollapseWatch
from meshtrain.train.tokenizer import prepare_data
from meshtrain.train.trainer import lr_at

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--no-progress", "--comm.transport=local", "--checkpoint.enabled=false"]


def _config(*overrides: str) -> Config:
    return load_config(None, list(overrides), check=False)


# -- 9: a warmup longer than the run -----------------------------------------------------------------

@pytest.mark.timeout(30)
def test_a_warmup_longer_than_the_run_is_clamped_with_a_note(capsys):
    assert main(["train", "--print-config", "--train.steps=10"]) == 0  # was: train.warmup_steps = 15 must be ...
    capsys.readouterr()
    t = TrainSection(steps=10, warmup_steps=15, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, t) for s in range(1, 11)]
    assert lrs == pytest.approx([s / 10 for s in range(1, 11)])  # warmed up over the 10 steps, lr at the last
    (line,) = [n for n in preflight.config_notes(_config("--train.steps=10"), cpu=True) if "warmup" in n]
    assert line.startswith("# preflight: train.warmup_steps = 15 is longer than the run's train.steps = 10")
    with pytest.raises(ConfigError, match="train.warmup_steps = -1 must be >= 0"):
        validate(_config("--train.warmup_steps=-1"))


# -- 7: the run against the machine -------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_more_processes_than_can_start_are_refused_before_any_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight, "host_cores", lambda: 2)  # the VM's cores, whatever runs the test
    out = tmp_path / "run"
    rc = main(["train", f"--out={out}", "--train.steps=2", *[a for a in SMALL if "transport" not in a],
               "--parallel.dp=64", "--parallel.tp=1", "--train.global_batch=64"])
    err = capsys.readouterr().err
    assert rc == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("meshtrain train: error:")]
    for words in ("64 worker processes cannot start on this host's 2 CPU core(s)", "within 3 s",
                  "The client socket has timed out after 3000ms", "at most 16 ranks here", "--comm.transport=local"):
        assert words in line, line
    assert not out.exists()


def test_ranks_beyond_the_cores_are_warned_with_the_cost_and_threads_are_not_refused():
    (line,) = preflight.check_machine(8, threads=False, on_cpu=True, cores=2)
    assert line.startswith("# preflight: 8 ranks on 2 CPU core(s)") and "4.0x the compute" in line
    assert preflight.check_machine(2, threads=False, on_cpu=True, cores=2) == []
    assert preflight.check_machine(8, threads=False, on_cpu=False, cores=2) == []  # a GPU's ranks compute there
    assert len(preflight.check_machine(64, threads=True, on_cpu=True, cores=2)) == 1  # threads: no store to starve
    with pytest.raises(ConfigError, match="17 worker processes cannot start"):
        preflight.check_machine(17, threads=False, on_cpu=False, cores=2)


def test_fp16_on_a_cpu_is_warned_and_bf16_suggested():
    (line,) = preflight.config_notes(_config("--train.precision=fp16"), cpu=True)
    assert "train.precision = 'fp16' on the CPU" in line and "--train.precision=bf16" in line
    assert preflight.config_notes(_config("--train.precision=fp16"), cpu=False) == []
    assert preflight.config_notes(_config("--train.precision=bf16"), cpu=True) == []


# -- 9: ZeRO with one rank to shard over --------------------------------------------------------------

def test_zero_at_dp_1_is_warned():
    readme = _config("--parallel.dp=1", "--parallel.tp=2", "--parallel.pp=2", "--parallel.microbatches=4",
                     "--parallel.zero_stage=1", "--train.steps=50")  # the README's example before this change
    (line,) = preflight.config_notes(readme, cpu=False)
    assert "parallel.zero_stage = 1 with dp = 1 and cp = 1" in line and "shards nothing" in line
    assert preflight.config_notes(_config("--parallel.dp=2", "--parallel.zero_stage=1"), cpu=False) == []
    assert preflight.config_notes(_config("--parallel.dp=1", "--parallel.cp=2", "--parallel.zero_stage=1"),
                                  cpu=False) == []  # ZeRO shards over dp x cp


# -- 8: the data described ----------------------------------------------------------------------------

def _corpus(tmp_path: Path, size: int = 6000) -> Path:
    words = " ".join(f"word{i % 97} value{i % 13}" for i in range(size // 10))
    path = tmp_path / "small.txt"
    path.write_text(words[:size])
    return path


@pytest.mark.timeout(60)
def test_a_small_corpus_is_described_once_with_its_epochs_and_repeats(tmp_path):
    config = _config(f"--data.path={_corpus(tmp_path)}", "--train.steps=20", "--train.seq_len=128")
    corpus, tok, tokens = prepare_data(config.data)
    lines = preflight.data_summary(config, corpus, tok, tokens)
    samples = (len(tokens) - 1) // 128
    summary = lines[0]
    assert summary.startswith(f"# data: {corpus.name}: 1 file (6.0 KB), 1 documents, {len(tokens):,} tokens -> "
                              f"{samples} samples of 129 tokens; 20 steps x 8 = 160 samples = {160 / samples:.2f} "
                              f"epochs"), summary
    repeats = preflight.repeated_batches(tokens, 128, 8, 0, 20)
    assert repeats > 0 and f"{repeats} of 20 batches hold a sample more than once" in summary
    assert "passes over its data" in lines[1]
    # the tokenizer came out smaller than asked: said so
    (note,) = preflight.vocab_note(config, tok)
    assert tok.vocab_size < 8192 and f"has {tok.vocab_size} tokens of the 8192 asked" in note


def test_repeats_are_counted_only_when_a_batch_straddles_epochs():
    import numpy as np

    tokens = np.arange(1001, dtype=np.int64)  # 10 samples of 100 tokens
    assert preflight.repeated_batches(tokens, 100, 5, 0, 2) == 0  # exactly one epoch
    assert preflight.repeated_batches(tokens, 100, 20, 0, 3) == 3  # every batch is two epochs


@pytest.mark.timeout(60)
def test_the_jsonl_text_field_is_configurable(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"content": f"document {i} " * 20}) + "\n" for i in range(40)))
    with pytest.raises(DataError, match='no "text" field \\(found: content\\).*set data.text_field'):
        prepare_data(DataSection(path=str(path), vocab_size=300))
    corpus, tok, tokens = prepare_data(DataSection(path=str(path), vocab_size=300, text_field="content"))
    assert len(tokens) > 400 and tok.decode(tokens[:3].tolist()).startswith("doc")
    assert _config("--data.text_field=content").data.text_field == "content"
    with pytest.raises(ConfigError, match="data.text_field = '' names no field"):
        validate(_config("--data.text_field="))


# -- 9: a per-step line without the progress bar ------------------------------------------------------

def _record(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.01, "step_s": 0.5,
            "peak_mem_bytes": 1}


def test_no_progress_prints_a_step_line_every_k_steps(tmp_path, capsys):
    assert line_every(120) == 6 and line_every(120, log_every=4) == 8 and line_every(10, 1, 3) == 3
    logger = MetricsLogger(tmp_path, total_steps=10, progress=False, print_every=4)
    for step in range(1, 11):
        logger.log(_record(step))
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in lines] == ["# step 4/10", "# step 8/10", "# step 10/10"]
    assert lines[0] == "# step 4/10: loss 4.6000, lr 0.001, 1000 tokens/s, MFU 1.0%, 0.500 s/step, ETA 3 s"


# -- 9: the planner's line once, with a remark when it is off ------------------------------------------

def test_a_prediction_off_by_more_than_its_stated_error_is_remarked():
    check = {"predicted_step_s": 0.21, "measured_step_s": 0.79, "prediction": {"compute": "roofline"}}
    line = preflight.plan_remark(check)
    assert line.startswith("# preflight: the measured step (0.7900 s) is 3.8x slower than the planner predicted")
    assert "beyond the 50% it states" in line and "docs/plan.md" in line and "'profiled'" in line
    assert preflight.plan_remark({**check, "measured_step_s": 0.25}) is None
    assert preflight.plan_remark({**check, "prediction": {"compute": "profiled"}, "measured_step_s": 0.27}) is not None
    assert preflight.plan_remark({"predicted_step_s": None, "measured_step_s": 0.2, "prediction": None}) is None


@pytest.mark.timeout(90)
def test_a_finished_run_prints_the_planner_and_the_data_once(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"--out={out}", "--train.steps=2", *SMALL, "--parallel.dp=1", "--parallel.tp=1"]) == 0
    got = capsys.readouterr()
    assert sum("planner" in x for x in got.out.splitlines()) == 1, got.out
    assert sum(x.startswith("# data: ") for x in got.err.splitlines()) == 1, got.err
    assert sum("warmup" in x for x in got.err.splitlines()) == 1  # 2 steps, the default warmup of 15: clamped
    assert [x.split(":")[0] for x in got.out.splitlines() if x.startswith("# step")] == ["# step 1/2", "# step 2/2"]


@pytest.mark.timeout(120)
def test_under_torchrun_rank_0_prints_the_notes_and_the_planner_once(tmp_path):
    """``python -m meshtrain.train`` as torchrun starts its workers (two ranks on this host), where
    no launcher prints the preflight: rank 0 does, once, and the planner line once."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = [a for a in SMALL if a not in ("--no-progress", "--comm.transport=local")]
    argv = [sys.executable, "-m", "meshtrain.train", f"--out={tmp_path / 'run'}", "--train.steps=2", *config,
            "--parallel.dp=2", "--parallel.tp=1", "--comm.backend=gloo", "--train.device=cpu"]
    procs = [subprocess.Popen(argv, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                         "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    (out0, err0), (out1, err1) = outs
    assert sum(x.startswith("# data: ") for x in err0.splitlines()) == 1, err0
    assert sum("warmup" in x for x in err0.splitlines()) == 1, err0  # 2 steps under the default warmup of 15
    assert sum(x.startswith("# planner:") for x in out0.splitlines()) == 1, out0
    assert "# data: " not in err1 and "# preflight" not in err1 and "# planner" not in out1  # rank 1: nothing


# -- 9: routing collapse ------------------------------------------------------------------------------

def test_routing_collapse_is_warned_once_naming_the_layer_and_experts():
    watch = CollapseWatch()
    even = [[40.0] * 8, [40.0] * 8]
    collapsed = [[40.0] * 8, [0, 100.0, 0, 100.0, 0, 120.0, 0, 0]]  # layer 3: 5 of 8 experts get no token
    lines = [watch.update({"step": s, "moe_layers": [1, 3], "moe_tokens": even if s < 3 else collapsed})
             for s in range(1, 20)]
    said = [(s, x) for s, x in enumerate(lines, 1) if x]
    assert len(said) == 1 and said[0][0] == 12  # 10 starved steps in a row, from step 3
    assert said[0][1].startswith("# moe: routing collapse at step 12: layer 3: experts 0, 2, 4, 6, 7 of 8 took")
    assert "layer 1" not in said[0][1] and "model.bias_update_rate" in said[0][1]


def test_a_brief_dip_is_not_a_collapse():
    watch = CollapseWatch()
    rows = [[0.0, 80.0] if s % 5 else [40.0, 40.0] for s in range(1, 30)]
    assert not any(watch.update({"step": s, "moe_layers": [0], "moe_tokens": [r]}) for s, r in enumerate(rows, 1))


# -- 9: meshtrain import's vocabulary advice ----------------------------------------------------------

@pytest.mark.timeout(60)
def test_import_of_a_small_vocabulary_names_the_tokenizer_not_model_vocab_size(tmp_path, capsys):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf)  # no tokenizer.json beside it
    out = tmp_path / "imported"
    assert main(["import", str(hf), "--out", str(out), "--convert-only", "--data.max_bytes=300000"]) == 2
    err = capsys.readouterr().err
    assert "holds a model of 512 tokens" in err and "--data.tokenizer=DIR" in err and "--data.vocab_size=512" in err
    assert "raise it" not in err and not out.exists()
