"""Bad input, end to end: every case of ``docs/errors.md`` through ``meshtrain train`` (or, where
the case needs it, the worker / the trainer / the rendezvous directly). Each exits non-zero with
one line naming the problem and the fix, writes no partial files and does not hang.

Ranks are threads (``--comm.transport=local``) except where a process is the point (the port).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.train import checkpoint_io
from meshtrain.train.config import load_config
from meshtrain.train.trainer import TrainingDiverged, train

from .._malicious import evil_pickle

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--train.warmup_steps=2", "--no-progress", "--comm.transport=local"]
ONE = ["--parallel.dp=1", "--parallel.tp=1"]


def _fail(tmp_path: Path, capsys, *args: str, run: str = "run") -> str:
    """Run ``meshtrain train`` with ``args``; check exit 2, one error line and no run directory;
    return the error line."""
    out = tmp_path / run
    rc = main(["train", f"--out={out}", "--train.steps=2", *SMALL, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    # after the launcher's notes (`# data: ...`, `# preflight: ...`, printed once before the ranks start)
    err = "".join(x for x in err.splitlines(keepends=True) if not x.startswith("# "))
    assert err.startswith("meshtrain train: error: "), err
    assert not out.exists(), f"{out} was created: {list(out.rglob('*'))}"
    return err


# -- configuration: rejected by validation before any rank starts -----------------------------------

CONFIG_CASES = {
    "layout-heads-not-divisible-by-tp": (["--parallel.dp=1", "--parallel.tp=3"], ["n_heads", "tp"]),
    "layout-kv-heads-not-divisible-by-tp": (["--parallel.dp=1", "--parallel.tp=4", "--model.n_heads=8",
                                            "--model.n_kv_heads=2"], ["n_kv_heads", "tp"]),
    "layout-more-stages-than-layers": (["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=8",
                                        "--parallel.microbatches=8", "--train.global_batch=8"],
                                       ["8 pipeline stages", "4 layers"]),
    "layout-seq-len-not-divisible-by-2cp": (["--parallel.dp=1", "--parallel.tp=1", "--parallel.cp=2",
                                             "--train.seq_len=30"], ["train.seq_len = 30", "2 x cp = 4", "32"]),
    "layout-1f1b-fewer-microbatches-than-stages": (["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=2",
                                                    "--parallel.microbatches=1"],
                                                   ["fewer micro-batches (m=1) than pipeline stages (pp=2)", "afab"]),
    "layout-global-batch-not-divisible": (["--parallel.dp=3", "--parallel.tp=1"],
                                          ["train.global_batch = 4", "dp x microbatches", "3"]),
    "layout-degree-zero": (["--parallel.dp=0"], ["parallel.dp = 0", ">= 1"]),
    "layout-sequence-parallel-without-tp": (["--parallel.dp=1", "--parallel.tp=1",
                                             "--parallel.sequence_parallel=true"], ["sequence_parallel", "tp > 1"]),
    "layout-tied-embeddings-with-pp": (["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=2",
                                        "--parallel.microbatches=2", "--model.tie_embeddings=true"],
                                       ["tie_embeddings", "pp = 1"]),
    "key-misspelt": (["--train.lrr=0.1"], ["unknown config key 'train.lrr'", "did you mean 'train.lr'"]),
    "section-misspelt": (["--trian.lr=0.1"], ["unknown config key 'trian.lr'", "train.lr"]),
    "override-without-value": (["--train.lr"], ["has no value", "--section.key=value"]),
    "wrong-type": (["--train.steps=abc"], ["train.steps must be an integer", "'abc'"]),
    "wrong-type-bool": (["--checkpoint.enabled=maybe"], ["checkpoint.enabled must be a boolean"]),
    "steps-zero": (["--train.steps=0"], ["train.steps = 0 must be >= 1"]),
    "lr-negative": (["--train.lr=-1e-3"], ["train.lr", "lr = -0.001"]),
    # (a warmup longer than the run is clamped with a note, no longer an error: tests/train/test_preflight.py)
    "warmup-negative": (["--train.warmup_steps=-1"], ["train.warmup_steps = -1 must be >= 0"]),
    "schedule-typo": (["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=2", "--parallel.microbatches=2",
                       "--parallel.schedule=1f1bb"], ["parallel.schedule = '1f1bb'", "1f1b"]),
    "preset-typo": (["--model.preset=tset"], ["unknown model.preset 'tset'", "did you mean 'test'"]),
    "transport-typo": (["--comm.transport=lcoal"], ["comm.transport = 'lcoal'", "local"]),
    "algorithm-typo": (["--comm.algorithm=rnig"], ["unknown comm.algorithm 'rnig'", "ring"]),
    "nccl-on-cpu": (["--comm.backend=nccl", "--train.device=cpu"], ["nccl", "gloo"]),
    "seq-len-over-max-seq-len": (["--train.seq_len=256", "--train.global_batch=4"],
                                 ["train.seq_len = 256", "model.max_seq_len = 128"]),
    "model-vocab-smaller-than-tokenizer": (["--model.vocab_size=300"], ["model.vocab_size = 300", "512"]),
    "data-vocab-too-small": (["--data.vocab_size=100"], ["data.vocab_size = 100", "257"]),
    "checkpoint-keep-zero": (["--checkpoint.keep=0"], ["checkpoint.keep >= 1", "keep = 0"]),
    "elastic-memory-every-negative": (["--elastic.enabled=true", "--elastic.memory_every=-1"],
                                      ["elastic.memory_every = -1 must be >= 0", "elastic.memory_every = 1"]),
    "precision-typo": (["--train.precision=fp8"], ["train.precision = 'fp8' is not one of fp32, bf16, fp16"]),
    "loss-scale-init-below-one": (["--train.precision=fp16", "--train.loss_scale_init=0"],
                                  ["train.loss_scale_init = 0.0 must be a finite number >= 1", "65536"]),
    "loss-scale-growth-interval-zero": (["--train.precision=fp16", "--train.loss_scale_growth_interval=0"],
                                        ["train.loss_scale_growth_interval = 0 must be >= 1", "2000"]),
    # ZeRO CPU offload
    "offload-without-zero": (["--parallel.dp=2", "--parallel.tp=1", "--parallel.offload=optimizer"],
                             ["parallel.offload = 'optimizer' needs ZeRO", "set parallel.zero_stage = 1, 2 or 3"]),
    "offload-params-without-stage-3": (["--parallel.dp=2", "--parallel.tp=1", "--parallel.zero_stage=2",
                                        "--parallel.offload=params"],
                                       ["parallel.offload = 'params' needs parallel.zero_stage = 3",
                                        "parallel.offload = 'optimizer' with stage 2"]),
    "offload-unknown": (["--parallel.offload=cpu"], ["parallel.offload = 'cpu' is not one of none, optimizer, params"]),
    # mixture of experts
    "ep-not-dividing-dp-shard": (["--model.preset=moe-test", "--parallel.dp=2", "--parallel.tp=1", "--parallel.ep=3"],
                                 ["parallel.ep = 3 must divide dp_shard = 2 x cp = 1", "[1, 2]"]),
    "ep-not-dividing-experts": (["--model.preset=moe-test", "--model.n_experts=6", "--parallel.dp=4", "--parallel.tp=1",
                                 "--parallel.ep=4"], ["parallel.ep = 4 does not divide model.n_experts = 6", "[1, 2, 3, 6]"]),
    "ep-on-a-dense-model": (["--parallel.dp=2", "--parallel.tp=1", "--parallel.ep=2"],
                            ["parallel.ep = 2 needs a mixture-of-experts model", "model.n_experts > 0"]),
    "top-k-over-experts": (["--model.preset=moe-test", "--model.moe_top_k=9"],
                           ["moe_top_k = 9 is larger than n_experts = 8", "moe_top_k <= 8"]),
    "capacity-factor-zero": (["--model.preset=moe-test", "--model.capacity_factor=0"],
                             ["capacity_factor = 0.0 must be > 0", "inf for dropless"]),
}
if not torch.cuda.is_available():  # a GPU machine would train there instead of failing
    CONFIG_CASES["device-cuda-without-gpu"] = (["--train.device=cuda"], ["train.device = 'cuda'", "no CUDA device",
                                                                        "train.device = 'cpu'"])


@pytest.mark.parametrize("args, needles", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_config_errors_exit_2_before_anything_is_written(tmp_path, capsys, args, needles):
    err = _fail(tmp_path, capsys, *args)
    for n in needles:
        assert n in err, err


def test_config_file_missing_invalid_or_wrongly_typed(tmp_path, capsys):
    err = _fail(tmp_path, capsys, f"--config={tmp_path / 'nope.toml'}")
    assert "config file" in err and "does not exist" in err and "--print-config" in err
    (tmp_path / "bad.toml").write_text("[train\nlr = 1\n")
    err = _fail(tmp_path, capsys, f"--config={tmp_path / 'bad.toml'}")
    assert "is not valid TOML" in err
    (tmp_path / "typed.toml").write_text('[train]\nsteps = "ten"\n')
    err = _fail(tmp_path, capsys, f"--config={tmp_path / 'typed.toml'}")
    assert "train.steps must be an integer, got str 'ten'" in err
    (tmp_path / "section.toml").write_text('[trainn]\nsteps = 3\n')
    err = _fail(tmp_path, capsys, f"--config={tmp_path / 'section.toml'}")
    assert "unknown config section 'trainn'" in err and "did you mean 'train'" in err


def test_layout_product_differs_from_the_world_size(tmp_path):
    """Under torchrun the world size comes from the launcher: 3 ranks for a dp2 layout."""
    config = load_config(None, [*SMALL[:-2], "--parallel.dp=2", "--parallel.tp=1", f"--out={tmp_path / 'r'}"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp\*cp = 2\*1\*1\*1 = 2 but the world size is 3"):
        comm.run_local(3, lambda rank: train(config, progress=False), timeout=30)
    assert time.monotonic() - t0 < 30 and not (tmp_path / "r").exists()


# -- data -----------------------------------------------------------------------------------------

def test_data_path_missing_empty_unsupported_or_malformed(tmp_path, capsys):
    err = _fail(tmp_path, capsys, f"--data.path={tmp_path / 'nowhere.txt'}")
    assert "DataError" not in err and "does not exist" in err and "nowhere.txt" in err
    (tmp_path / "empty.txt").write_text("")
    assert "is empty" in _fail(tmp_path, capsys, f"--data.path={tmp_path / 'empty.txt'}")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.csv").write_text("x,y\n")
    err = _fail(tmp_path, capsys, f"--data.path={tmp_path / 'dir'}")
    assert "no .txt, .jsonl or .parquet files" in err and "a.csv" in err
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n{"body": "no text"}\n')
    err = _fail(tmp_path, capsys, f"--data.path={tmp_path / 'd.jsonl'}")
    assert "d.jsonl:2" in err and 'no "text" field' in err and "body" in err
    (tmp_path / "bin.txt").write_bytes(b"ok \xff\xfe")
    assert "is not UTF-8" in _fail(tmp_path, capsys, f"--data.path={tmp_path / 'bin.txt'}")
    err = _fail(tmp_path, capsys, f"--data.tokenizer={tmp_path / 'no-tokenizer'}")
    assert "tokenizer" in err and "not found" in err


# -- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of 2 steps on one rank with checkpoints after steps 1 and 2."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert main(["train", f"--out={out}", "--train.steps=2", "--checkpoint.every=1", *SMALL, *ONE]) == 0
    return out / "checkpoints"


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def _resume_fails(tmp_path, capsys, target: Path, *args: str, run: str = "run") -> str:
    return _fail(tmp_path, capsys, "--train.steps=3", *ONE, f"--checkpoint.resume={target}", *args, run=run)


def test_resume_from_a_path_with_no_checkpoint(tmp_path, capsys):
    err = _resume_fails(tmp_path, capsys, tmp_path / "nowhere")
    assert "no checkpoint at" in err and "start without resuming" in err


@pytest.mark.parametrize("args, needles", [
    (["--data.vocab_size=1024"], ["tok_emb.weight", "(512, 128)", "(1024, 128)", "vocabulary differs",
                                  "data.vocab_size"]),
    (["--model.vocab_size=640"], ["tok_emb.weight", "(512, 128)", "(640, 128)", "vocabulary differs"]),
    (["--model.dim=64"], ["tok_emb.weight", "(512, 128)", "(512, 64)", "model config must match"]),
    (["--model.ffn_dim=256"], ["(344, 128)", "(256, 128)", "model config must match"]),
    (["--model.n_layers=6"], ["has no tensor", "layers.4", "different model"]),
], ids=["data-vocab", "model-vocab", "model-dim", "ffn-dim", "more-layers"])
def test_resume_with_another_vocabulary_or_model_shape(saved, tmp_path, capsys, args, needles):
    err = _resume_fails(tmp_path, capsys, saved, *args)
    for n in needles:
        assert n in err, err


def _shard(root: Path) -> Path:
    return next((root / "step-00000002").glob("rank-*.safetensors"))


@pytest.mark.parametrize("damage, needle", [
    ("truncate", "truncated or corrupt"),
    ("flip", "its sha256 differs"),
    ("delete", "is missing"),
    ("metadata", "cannot read"),
    ("torn", "is incomplete: it has no metadata.json"),
])
def test_damaged_checkpoint_is_named_and_nothing_is_loaded(saved, tmp_path, capsys, damage, needle):
    root = _copy(saved, tmp_path)
    shard = _shard(root)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    elif damage == "metadata":
        (root / "step-00000002" / "metadata.json").write_text('{"format": "meshtrain.checkpoint", ')
    else:  # a save killed before its commit marker: the step dir without metadata.json
        (root / "step-00000002" / "metadata.json").unlink()
    err = _resume_fails(tmp_path, capsys, root / "step-00000002")
    assert needle in err and "step-00000002" in err, err
    if damage == "torn":
        assert "resume from the previous complete checkpoint" in err and "step-00000001" in err
    else:
        assert "resume from" in err


def test_a_torn_save_is_ignored_by_resume_auto_and_refused_by_path(saved, tmp_path, capsys):
    """A save killed mid-write leaves ``step-N.tmp`` (half a shard, no metadata.json) and ``latest``
    on the previous step: auto-resume takes that one; naming the torn dir is refused."""
    import json

    out = tmp_path / "run"
    shutil.copytree(saved, out / "checkpoints")
    torn = out / "checkpoints" / "step-00000003.tmp"
    torn.mkdir()
    shard = _shard(out / "checkpoints")
    (torn / shard.name).write_bytes(shard.read_bytes()[:1000])
    err = _resume_fails(tmp_path, capsys, torn, run="other")
    assert "is incomplete: it has no metadata.json" in err and "step-00000002" in err
    rc = main(["train", f"--out={out}", "--train.steps=3", *SMALL, *ONE, "--checkpoint.resume=auto"])
    assert rc == 0, capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3]  # resumed from step 2
    assert not torn.exists()  # the next commit cleaned it up


# -- during training ------------------------------------------------------------------------------

def test_loss_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    from meshtrain.parallel.parallel_model import ParallelModel

    real = ParallelModel.forward_backward
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        loss = real(self, *a, **k)
        calls["n"] += 1
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(ParallelModel, "forward_backward", poisoned)
    out = tmp_path / "run"
    rc = main(["train", f"--out={out}", "--train.steps=4", "--checkpoint.every=1", *SMALL, *ONE])
    err = capsys.readouterr().err
    assert rc == 2
    root = out / "checkpoints"
    assert "TrainingDiverged" not in err and "the loss became nan at step 3" in err and "train.lr" in err
    assert f"resume from the last good checkpoint {root / 'step-00000002'}" in err
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_huge_learning_rate_diverges_with_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", f"--out={out}", "--train.steps=6", "--train.lr=1e6", "--train.warmup_steps=0",
               "--checkpoint.every=1", *SMALL, *ONE])
    err = capsys.readouterr().err
    assert rc == 2 and "meshtrain train: error:" in err and "became" in err and "at step" in err, err
    step = int(err.split("at step ")[1].split(";")[0])
    root = out / "checkpoints"
    assert not (root / f"step-{step:08d}").exists() and not list(root.glob("*.tmp"))
    if step > 1:
        assert (root / "latest").read_text().strip() == f"step-{step - 1:08d}"


def test_gradient_norm_inf_stops_before_the_weights_change(tmp_path):
    from meshtrain.train import trainer

    config = load_config(None, [*SMALL[:-2], *ONE, "--train.steps=3", "--checkpoint.every=1",
                                f"--out={tmp_path / 'run'}"])
    seen = {}

    def run(rank):
        import meshtrain.parallel.parallel_model as pm

        real = pm.ParallelOptimizer.clip_grad_norm_

        def clip(self, max_norm):
            norm = real(self, max_norm)
            seen["n"] = seen.get("n", 0) + 1
            return torch.full_like(norm, float("inf")) if seen["n"] == 2 else norm

        pm.ParallelOptimizer.clip_grad_norm_ = clip
        try:
            return trainer.train(config, progress=False)
        finally:
            pm.ParallelOptimizer.clip_grad_norm_ = real

    with pytest.raises(TrainingDiverged, match="the gradient norm became inf at step 2"):
        comm.run_local(1, run, timeout=30)
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-00000001"


class _FullDisk:
    """``open`` for checkpoint_io: files under step-00000002's temp dir take half the data, then
    the disk is full."""

    def __init__(self, real):
        self.real, self.hits = real, 0

    def __call__(self, path, mode="r", *a, **k):
        f = self.real(path, mode, *a, **k)
        if "step-00000002.tmp" not in str(path) or "w" not in mode:
            return f
        self.hits += 1
        write = f.write

        def full(data):
            write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        f.write = full
        return f


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    import builtins

    disk = _FullDisk(builtins.open)
    monkeypatch.setattr(checkpoint_io, "open", disk, raising=False)
    out = tmp_path / "run"
    rc = main(["train", f"--out={out}", "--train.steps=3", "--checkpoint.every=1", *SMALL, *ONE])
    err = capsys.readouterr().err
    assert rc == 2 and disk.hits == 1, err
    assert "no space left on the device" in err and "free disk space" in err and "previous one is kept" in err
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]  # no partial step-2 dir
    assert (root / "latest").read_text().strip() == "step-00000001"
    monkeypatch.undo()
    rc = main(["train", f"--out={out}", "--train.steps=3", "--checkpoint.resume=auto", *SMALL, *ONE])
    assert rc == 0, capsys.readouterr().err  # the previous checkpoint still loads (sha256 verified)


# -- processes and ranks --------------------------------------------------------------------------

def _free_listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.timeout(60)
def test_rendezvous_port_already_in_use(tmp_path):
    """A torchrun-style worker (rank 0 hosts the store) whose MASTER_PORT another process holds."""
    with _free_listener() as s:
        port = s.getsockname()[1]
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "meshtrain.train", f"--out={tmp_path / 'run'}",
                               "--train.steps=1", *SMALL[:-2], *ONE, "--train.warmup_steps=0", "--comm.transport=torch",
                               "--comm.init_timeout_s=10", "--comm.timeout_s=10"],
                              env=env, capture_output=True, text=True, timeout=50)
    assert time.monotonic() - t0 < 50
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"127.0.0.1:{port}" in proc.stderr and "already in use" in proc.stderr and "free port" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_a_worker_whose_master_port_is_held_by_another_program_fails_in_time():
    """A non-zero rank whose MASTER_PORT answers but is not a store: torch's client would wait
    forever in its handshake; comm.init gives up after init_timeout and names the address."""
    with _free_listener() as s:
        port = s.getsockname()[1]
        env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        code = "from meshtrain import comm; comm.init(transport='torch', timeout=60, init_timeout=2)"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
        elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "not a torch.distributed store" in proc.stderr, proc.stderr[-2000:]
    assert "free one" in proc.stderr
    assert elapsed < 30  # 2 s of init timeout + the interpreter's start, not the 60 s collective timeout


@pytest.mark.parametrize("key, values", [("train.lr", ("0.002", "0.01")), ("train.seq_len", ("32", "16"))])
def test_a_rank_started_with_another_config_is_named(tmp_path, key, values):
    """Two ranks, as two torchrun workers given different overrides: rank 1's differs."""
    base = [*SMALL[:-2], "--parallel.dp=2", "--parallel.tp=1", f"--out={tmp_path / 'run'}"]
    configs = [load_config(None, [*base, f"--{key}={v}"]) for v in values]
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        comm.run_local(2, lambda rank: train(configs[rank], progress=False), timeout=30)
    msg = str(info.value)
    assert "rank(s) [1] were started with a different config than rank 0" in msg and key in msg, msg
    assert "same config file" in msg and time.monotonic() - t0 < 30
    assert not (tmp_path / "run").exists()


def test_same_config_on_every_rank_passes_the_check(tmp_path):
    config = load_config(None, [*SMALL[:-2], "--parallel.dp=2", "--parallel.tp=1", f"--out={tmp_path / 'r'}"])
    from meshtrain.train.trainer import check_same_config

    assert comm.run_local(2, lambda rank: check_same_config(config), timeout=30) == [None, None]


def test_a_planted_pickle_is_never_loaded(saved, tmp_path, capsys):
    """Metadata redirected to a pickle file: refused by name; pickles beside the shards: ignored."""
    import json

    root = _copy(saved, tmp_path)
    step = root / "step-00000002"
    marker = tmp_path / "pwned"
    for name in ("model.pt", "rank-00000.pt"):
        (step / name).write_bytes(evil_pickle(str(marker)))
    meta = json.loads((step / "metadata.json").read_text())
    meta["entries"][0]["file"] = "rank-00000.pt"
    (step / "metadata.json").write_text(json.dumps(meta))
    err = _resume_fails(tmp_path, capsys, step)
    assert "rank-00000.pt" in err and "not a shard of this checkpoint" in err and "tampered" in err
    assert not marker.exists()
