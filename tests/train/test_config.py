"""The training config: defaults, TOML + overrides, round trip, and every error's message."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from meshtrain.errors import ConfigError
from meshtrain.models.llama import PRESETS, LlamaConfig
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.train import config as C
from meshtrain.train.config import Config, load_config, model_config, parallel_config, to_toml, validate

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return str(p)


def _error(overrides: list[str], path: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_defaults_are_the_main_job():
    c = load_config()
    assert (c.parallel.dp, c.parallel.tp, c.parallel.pp, c.parallel.cp) == (2, 2, 1, 1)
    assert c.parallel.world_size == 4
    assert c.model.preset == "10m" and c.data.path == "" and c.data.tokenizer == ""
    assert 128 <= c.train.seq_len <= 256 and 8 <= c.train.global_batch <= 16
    mc = model_config(c)
    assert (mc.dim, mc.n_layers, mc.vocab_size) == (320, 6, 8192)
    assert parallel_config(c) == ParallelConfig()


def test_sections_mirror_the_model_and_parallel_configs():
    overridable = {f.name for f in dataclasses.fields(C.ModelSection)} - {"preset"}
    assert overridable == {f.name for f in dataclasses.fields(LlamaConfig)}
    assert {f.name for f in dataclasses.fields(ParallelConfig)} <= {f.name for f in dataclasses.fields(C.ParallelSection)}


def test_every_field_has_a_docstring():
    for cls in [Config, *C.SECTIONS.values()]:
        docs = C.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: {missing}"


def test_override_precedence(tmp_path):
    path = _write(tmp_path, "out = 'a'\n[train]\nsteps = 10\nwarmup_steps = 2\nlr = 1e-3\n[parallel]\ndp = 4\n")
    c = load_config(path, ["--train.steps=20", "train.steps=30", "--model.dim", "128"])
    assert c.train.steps == 30  # overrides beat the file; the later override wins
    assert c.train.lr == 1e-3 and c.parallel.dp == 4 and c.out == "a"  # file beats defaults
    assert c.model.dim == 128  # "--key value" pairs work too
    assert load_config(path, ["--out=b"]).out == "b"


def test_values_are_parsed_to_the_field_type():
    c = load_config(None, ["--parallel.sequence_parallel=yes", "--comm.check=0", "--train.lr=3e-4",
                           "--data.max_bytes=1_000_000", "--model.tie_embeddings=true", "--model.dim=none"])
    assert c.parallel.sequence_parallel is True and c.comm.check is False
    assert c.train.lr == 3e-4 and c.data.max_bytes == 1_000_000
    assert c.model.tie_embeddings is True and c.model.dim is None
    assert isinstance(load_config(None, ["--train.lr=1", "--train.min_lr=0"]).train.lr, float)


def test_toml_round_trip(tmp_path):
    c = load_config(None, ["--model.dim=128", "--model.rope_theta=500000", "--train.lr=0.00025",
                           "--data.path=we \"quote\" \\ back", "--out=runs/x", "--comm.check=false",
                           "--checkpoint.every=5"])
    for comments in (True, False):
        text = to_toml(c, comments=comments)
        back = load_config(_write(tmp_path, text))
        assert back == c
        assert C.to_dict(back) == C.to_dict(c)
    assert "# Override: hidden size." in to_toml(c)  # --print-config documents each key


def test_unknown_key_suggests_the_nearest():
    assert _error(["--train.lrr=1"]) == "unknown config key 'train.lrr'; did you mean 'train.lr'?"
    assert "did you mean 'train.lr'?" in _error(["--trian.lr=1"])
    assert "did you mean 'train.lr'?" in _error(["--lr=1"])  # a bare key: found in its section
    assert "did you mean 'parallel.sequence_parallel'?" in _error(["--train.sequence_parallel=1"])
    assert "valid: " in _error(["--zzz.qqq=1"])  # nothing close: list the keys


def test_unknown_toml_section_and_key(tmp_path):
    msg = _error([], _write(tmp_path, "[trian]\nsteps = 3\n"))
    assert msg == "unknown config section 'trian'; did you mean 'train'?"
    assert "unknown config key 'parallel.zero'; did you mean 'parallel.zero_stage'?" == \
        _error([], _write(tmp_path, "[parallel]\nzero = 1\n"))
    assert "'train' is a section" in _error([], _write(tmp_path, "train = 3\n"))


def test_wrong_type(tmp_path):
    assert _error(["--train.steps=ten"]).startswith("train.steps must be an integer, got 'ten'")
    assert _error(["--comm.check=maybe"]).startswith("comm.check must be a boolean, got 'maybe'")
    msg = _error([], _write(tmp_path, "[train]\nsteps = \"10\"\n"))
    assert msg.startswith("train.steps must be an integer, got str '10'")
    assert "must be a number, got bool True" in _error([], _write(tmp_path, "[train]\nlr = true\n"))
    assert "must be an integer, got float 2.5" in _error([], _write(tmp_path, "[parallel]\ndp = 2.5\n"))


def test_bad_override_syntax():
    assert "has no value: write --section.key=value" in _error(["--train.steps"])
    assert "has no value" in _error(["train.steps"])
    assert "bad override '--a.b.c=1'" in _error(["--a.b.c=1"])
    assert "bad override '--=3'" in _error(["--=3"])
    assert _error(["--train=3"]) == "'train' is a section, not a key: set one of its keys, e.g. train.steps"


def test_missing_and_invalid_files(tmp_path):
    assert "does not exist" in _error([], str(tmp_path / "nope.toml"))
    assert "is not valid TOML" in _error([], _write(tmp_path, "[train\nsteps = 1\n"))


@pytest.mark.parametrize("overrides, expected", [
    (["--train.global_batch=7"], "train.global_batch = 7 is not divisible by dp x microbatches = 2 x 1 = 2; "
                                 "use train.global_batch = 6 or 8"),
    (["--parallel.microbatches=3"], "train.global_batch = 8 is not divisible by dp x microbatches = 2 x 3 = 6"),
    (["--parallel.cp=2", "--parallel.dp=1", "--train.seq_len=130"], "train.seq_len = 130 is not divisible by 2 x cp = 4"),
    (["--parallel.sequence_parallel=true", "--parallel.tp=1"], "parallel.sequence_parallel = true needs parallel.tp > 1"),
    (["--parallel.sequence_parallel=true", "--train.seq_len=129"], "train.seq_len = 129 is not divisible by cp x tp = 2"),
    (["--train.warmup_steps=-1"], "train.warmup_steps = -1 must be >= 0 (0: no warmup); set e.g. --train.warmup_steps=12"),
    (["--parallel.schedule=gpipe"], "parallel.schedule = 'gpipe': unknown pipeline schedule 'gpipe'"),
    (["--parallel.pp=2"], "fewer micro-batches (m=1) than pipeline stages (pp=2)"),
    (["--parallel.zero_stage=4"], "parallel.zero_stage = 4: use 0"),
    (["--parallel.tp=3"], "model.n_heads = 8 is not divisible by tp = 3"),
    (["--parallel.dp=0"], "positive integers, got parallel.dp = 0 (each >= 1; 1 turns a dimension off)"),
    (["--parallel.ep=3"], "parallel.ep = 3 must divide dp_shard = 2 x cp = 1 (= 2)"),
    (["--parallel.ep=2"], "parallel.ep = 2 needs a mixture-of-experts model"),
    (["--parallel.dp_replicate=3"], "parallel.dp_replicate = 3 must be a positive integer that divides dp = 2 "
                                    "(dp = dp_replicate x dp_shard); use one of [1, 2]"),
    (["--train.seq_len=1024"], "train.seq_len = 1024 is longer than model.max_seq_len = 512"),
    (["--model.preset=10n"], "unknown model.preset '10n'; did you mean '10m'?"),
    (["--comm.transport=mpi"], "comm.transport = 'mpi' is not one of auto, local, shm, torch"),
    (["--comm.algorithm=rng"], "unknown comm.algorithm 'rng'; did you mean 'ring'?"),
    (["--comm.backend=nccl", "--train.device=cpu"], "comm.backend = 'nccl' needs train.device = 'cuda'"),
    (["--model.vocab_size=1000"], "model.vocab_size = 1000 is smaller than the tokenizer's vocabulary (8192)"),
])
def test_validate_names_field_and_fix(overrides, expected):
    assert expected in _error(overrides)
    load_config(None, overrides, check=False)  # the values themselves parse; only validate objects


def test_model_vocab_follows_the_tokenizer():
    c = load_config(None, ["--parallel.tp=1", "--parallel.dp=4"])
    assert model_config(c, tokenizer_vocab=1000).vocab_size == 1024  # padded to a multiple of 64
    assert model_config(load_config(None, ["--model.vocab_size=1000"], check=False), 900).vocab_size == 1000


def test_resolve_out_is_a_dated_run_dir():
    c = C.resolve_out(Config(), now=0.0)
    assert c.out.startswith("runs/") and len(c.out.split("/")[1]) == len("YYYYmmdd-HHMMSS")
    assert C.resolve_out(Config(out="mine")).out == "mine"
    validate(c)


def test_loading_a_config_imports_no_torch():
    """The config layer is torch-free: in a fresh interpreter, importing it, loading (and so
    validating) the default config and printing it as TOML pull in neither torch nor meshtrain.comm."""
    code = ("import sys; from meshtrain.config import load_config, model_config, parallel_config, to_toml; "
            "c = load_config(); model_config(c); parallel_config(c); to_toml(c); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'meshtrain.comm', "
            "'meshtrain.models.llama', 'meshtrain.parallel.parallelize', 'meshtrain.train'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"loading a config imported: {proc.stdout}"


def test_print_config_round_trips_through_the_cli(tmp_path, capsys):
    """``meshtrain train --print-config`` prints a TOML file that loads back to the same config."""
    from meshtrain.cli import main

    args = ["--model.dim=128", "--model.tie_embeddings=true", "--parallel.zero_stage=2", "--train.lr=3e-4",
            "--data.path=a \"b\" c", "--comm.algorithm=ring", "--out=runs/x"]
    assert main(["train", "--print-config", *args]) == 0
    text = capsys.readouterr().out
    assert load_config(_write(tmp_path, text)) == load_config(None, args)
    assert main(["train", "--print-config", f"--config={_write(tmp_path, text)}"]) == 0
    assert capsys.readouterr().out == text  # printing the printed file changes nothing


def test_model_section_is_derived_from_llama_config():
    """[model] has one optional key per LlamaConfig field, of that field's type, documented from
    the field's own docstring (plus what the key adds), in LlamaConfig's order."""
    llama_docs, docs = C.field_docs(LlamaConfig), C.field_docs(C.ModelSection)
    names = [f.name for f in dataclasses.fields(C.ModelSection)]
    assert names == ["preset"] + [f.name for f in dataclasses.fields(LlamaConfig)]
    hints, model_hints = typing.get_type_hints(C.ModelSection), typing.get_type_hints(LlamaConfig)
    for name in names[1:]:
        assert getattr(C.ModelSection(), name) is None
        assert hints[name] == typing.Optional[model_hints[name]]
        assert docs[name].startswith("Override: ") and llama_docs[name][1:].rstrip(".") in docs[name], name
    assert "padded to a multiple of 64 and tp" in docs["vocab_size"] and "needs pp = 1" in docs["tie_embeddings"]
    assert all(f'"{name}"' in docs["preset"] for name in PRESETS)


def test_config_modules_import_each_other_one_way():
    """schema <- check <- loading: no config module imports one that imports it back, and the
    meshtrain.train names are the same objects as meshtrain.config's."""
    import ast
    import meshtrain.config as pkg
    from meshtrain.train import config_check

    order = ["model", "dims", "parallel", "schema", "check", "loading"]
    for i, name in enumerate(order):
        tree = ast.parse((Path(pkg.__file__).parent / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
        assert imported <= set(order[:i]), f"{name}.py imports {imported - set(order[:i])}"
    assert C.load_config is pkg.load_config and C.Config is pkg.Config and C.validate is pkg.validate
    assert config_check.validate is pkg.validate and LlamaConfig is pkg.LlamaConfig
    assert ParallelConfig is pkg.ParallelConfig


def test_parallel_config_rules_are_written_once_and_name_the_config_key():
    """ParallelConfig's checks (parallel.py) run for ParallelConfig(...) naming the field and for a
    run's config naming the key: train.precision, not parallel.precision, which a run does not read."""
    assert _error(["--train.precision=fp64"]) == "train.precision = 'fp64' is not one of fp32, bf16, fp16"
    assert _error(["--parallel.virtual_stages=0"]) == "parallel.virtual_stages = 0 must be a positive integer"
    assert _error(["--parallel.activation_checkpointing=x"]) == \
        "parallel.activation_checkpointing = 'x' is not one of none, full, selective"
    with pytest.raises(ConfigError, match=r"^precision = 'fp64' is not one of fp32, bf16, fp16$"):
        ParallelConfig(precision="fp64")
    c = load_config(None, ["--parallel.precision=bf16", "--parallel.compile=true"])
    assert (parallel_config(c).precision, parallel_config(c).compile) == ("fp32", False)  # [train]'s
    assert "takes it from train.precision" in C.field_docs(C.ParallelSection)["precision"]
    assert "takes it from train.compile" in to_toml(c)
