"""``meshtrain train --parallel.auto=true`` trains on the layout the planner ranks first (the ranking
computed here, in the same test), and refuses what it cannot do with a named error."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest
import torch

from meshtrain.cli import main
from meshtrain.config.check import model_config
from meshtrain.config.loading import load_config
from meshtrain.errors import ConfigError
from meshtrain.plan import auto
from meshtrain.plan.architectures import from_llama_config
from meshtrain.plan.host import this_host
from meshtrain.plan.search import search
from meshtrain.train.launch import main_torchrun

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=8",
         "--train.seq_len=32", "--train.warmup_steps=1", "--no-progress"]


@pytest.fixture
def analytic_host(monkeypatch):
    """this-host priced by its roofline rather than by profiling: fast and the same on every call
    (profiling has its own tests)."""
    cluster = dataclasses.replace(this_host(peak=1e11, bandwidth=5e10, base_memory=3e8), profile_compute=False)
    monkeypatch.setattr(auto, "cluster_for", lambda device: cluster)
    return cluster


def test_auto_trains_on_the_layout_the_plan_ranks_first(tmp_path, analytic_host, capsys):
    out = tmp_path / "run"
    args = [f"--out={out}", "--train.steps=3", "--comm.transport=local", "--parallel.dp=2", "--parallel.tp=2", *SMALL]
    assert main(["train", "--parallel.auto=true", *args]) == 0
    chosen = tomllib.loads((out / "config.toml").read_text())["parallel"]
    # the planner's ranking for the same model, batch and 4 ranks
    config = load_config(None, [a for a in args if a != "--no-progress"])
    arch = from_llama_config("test", model_config(config, 512))
    first = search(arch, analytic_host, 4, 8, 32, {"precision": "fp32", "compile": False}, top=1)[0].layout
    assert (chosen["dp"], chosen["tp"], chosen["pp"], chosen["cp"], chosen["zero_stage"], chosen["microbatches"]) == \
        (first.dp, first.tp, first.pp, first.cp, first.zero_stage, first.microbatches)
    assert chosen["auto"] is False  # the saved config is the layout that ran (a resume does not re-plan)
    assert first.label() in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["world_size"] == 4


def test_auto_names_the_gpu_it_cannot_price(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-32GB")
    with pytest.raises(ConfigError, match="no cluster preset prices a 'Tesla V100-SXM2-32GB'.*H100"):
        auto.cluster_for("cuda")


def test_auto_under_torchrun_is_refused_before_any_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert main_torchrun(["--parallel.auto=true", f"--out={out}", *SMALL[:-1]]) == 2
    assert "torchrun does not let it" in capsys.readouterr().err
    assert not out.exists()
