"""``meshtrain export | import | generate``: a tp2 checkpoint exported loads in ``transformers`` with
meshtrain's logits; imported back it is bitwise the same and trains under another layout from the
same loss; greedy generation equals a plain argmax loop; bad input exits 2 and writes nothing.

The reference model is independent of ``meshtrain.train.hf``: a one-rank ``ParallelModel`` that
``load_checkpoint`` fills, whose stage is a plain ``Llama``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
import transformers  # the dev extra installs it; meshtrain export itself does not need it

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.mesh import Mesh
from meshtrain.models.llama import PRESETS, Llama, apply_rotary, rotary_table
from meshtrain.parallel.parallel_model import ParallelModel, unwrap
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint
from meshtrain.train.checkpoint_io import CheckpointReader
from meshtrain.train.config import Config, DataSection, to_dict
from meshtrain.train.hf import from_hf_permute, to_hf_permute
from meshtrain.train.loader import GlobalBatchLoader
from meshtrain.train.tokenizer import load_tokenizer, prepare_data

DATA = ["--data.max_bytes=300000", "--train.global_batch=4", "--train.seq_len=32", "--no-progress",
        "--comm.transport=local"]
CFG = dataclasses.replace(PRESETS["test"], vocab_size=512)  # data.vocab_size=512, padded for tp2: 512


def _plain(rank: int, path: str, cfg=CFG) -> Llama:
    model = ParallelModel(cfg, Mesh(dp=1, tp=1), ParallelConfig(), seed=1)
    load_checkpoint(path, model, optimizer=None)
    return unwrap(model.stages[0]).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "run"
    assert main(["train", "--model.preset=test", "--data.vocab_size=512", "--train.steps=2", "--train.warmup_steps=1",
                 "--parallel.dp=1", "--parallel.tp=2", f"--out={out}", *DATA]) == 0
    return out


@pytest.fixture(scope="module")
def reference(run) -> Llama:
    return comm.run_local(1, _plain, str(run / "checkpoints"))[0]


@pytest.fixture(scope="module")
def hf_dir(run) -> Path:
    out = run.parent / "hf"
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(out)]) == 0
    return out


def _model_tensors(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(str(path)) as r:
        return {k: r.read(k, [(0, n) for n in r.global_shape(k)]) for k in r.keys("model/")}


def test_rotary_permutation_turns_interleaved_pairs_into_hf_halves():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, d, s = 3, 8, 5
    w, x = torch.randn(heads * d, 16), torch.randn(1, s, 16)
    assert torch.equal(from_hf_permute(to_hf_permute(w, heads), heads), w)
    cos, sin = rotary_table(d, torch.arange(s), 10000.0)
    ours = apply_rotary((x @ w.T).view(1, s, heads, d).transpose(1, 2), cos, sin)
    hf_in = (x @ to_hf_permute(w, heads).T).view(1, s, heads, d).transpose(1, 2)
    hf, _ = apply_rotary_pos_emb(hf_in, hf_in, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    # the same vectors, each head's components in HF's order: so q.k (the attention) is unchanged
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    torch.testing.assert_close(hf, ours[..., perm], rtol=1e-6, atol=1e-6)


def test_export_loads_in_transformers_with_meshtrain_logits(run, reference, hf_dir, capsys):
    conf = json.loads((hf_dir / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["head_dim"] == 32
    assert (conf["hidden_size"], conf["num_hidden_layers"], conf["num_key_value_heads"], conf["vocab_size"]) == \
        (128, 4, 2, 512)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.3.mlp.down_proj.weight", "model.layers.0.post_attention_layernorm.weight"} <= names
    assert len(names) == 3 + 4 * 9
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - reference(tokens)).abs().max().item()
    assert diff < 1e-4
    # the run's tokenizer came along, and transformers reads it as meshtrain does
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok("def f(x):\n")["input_ids"] == load_tokenizer(hf_dir).encode("def f(x):\n")
    assert tok.eos_token == "<|endoftext|>"


def test_export_tied_embeddings_and_other_rope_theta(tmp_path, capsys):
    cfg = dataclasses.replace(CFG, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6)
    config = Config()
    config.model.preset, config.model.tie_embeddings, config.model.rope_theta = "test", True, 500000.0
    config.model.norm_eps, config.data.path, config.parallel.dp = 1e-6, str(tmp_path / "gone.txt"), 1

    def save(rank: int) -> Llama:
        model = ParallelModel(cfg, Mesh(dp=1, tp=1), ParallelConfig(), seed=3)
        with torch.no_grad():  # norms start at one: perturb everything so a wrong mapping shows
            for _, p in model.named_parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        save_checkpoint(str(tmp_path / "ck"), 5, model, None, extra={"config": to_dict(config)})
        return unwrap(model.stages[0]).eval()

    ref = comm.run_local(1, save)[0]
    assert main(["export", "--checkpoint", str(tmp_path / "ck" / "step-00000005"), "--out", str(tmp_path / "hf")]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["tie_word_embeddings"] and conf["rope_theta"] == 500000.0 and conf["rms_norm_eps"] == 1e-6
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - ref(tokens)).abs().max().item() < 1e-4
    # no tokenizer to be found: generation says so instead of decoding with a wrong one
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prompt", "x"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def _tp2_load(rank: int, path: str, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model = ParallelModel(CFG, Mesh(dp=1, tp=2), ParallelConfig(), seed=7)
    load_checkpoint(path, model, optimizer=None)
    loss = float(model.forward_backward(tokens[:, :-1], tokens[:, 1:]))
    return loss, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_import_round_trip_is_bitwise_and_loads_under_tp2(run, reference, hf_dir, tmp_path, capsys):
    out = tmp_path / "imported"
    assert main(["import", str(hf_dir), "--out", str(out), "--convert-only", *DATA]) == 0
    assert "meshtrain train --config" in capsys.readouterr().out
    init = out / "checkpoints" / "step-00000000"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000000"
    assert "dim = 128" in (out / "config.toml").read_text()
    original, back = _model_tensors(run / "checkpoints" / "step-00000002"), _model_tensors(init)
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(2))
    got = comm.run_local(2, _tp2_load, str(init), tokens)
    want = comm.run_local(2, _tp2_load, str(run / "checkpoints"), tokens)
    with torch.no_grad():
        ref_loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
    for (loss, params), (_, wparams) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert all(torch.equal(params[n], wparams[n]) for n in wparams)


def test_import_trains_under_another_layout_from_the_imported_loss(reference, hf_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["import", str(hf_dir), "--out", str(out), "--train.steps=1", "--train.warmup_steps=1",
                 "--parallel.dp=2", "--parallel.tp=1", "--parallel.zero_stage=1", *DATA]) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    _, _, tokens = prepare_data(DataSection(tokenizer=str(hf_dir), max_bytes=300000))
    batch = GlobalBatchLoader(tokens, 32, 4, seed=0).next_batch()
    with torch.no_grad():
        want = F.cross_entropy(reference(batch.inputs).flatten(0, 1), batch.targets.flatten()).item()
    assert row["samples"] == batch.sample_ids and row["loss"] == pytest.approx(want, rel=1e-5)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000001"


def test_generate_greedy_is_deterministic_and_equals_an_argmax_loop(run, reference, hf_dir, capsys):
    root = str(run / "checkpoints")
    args = ["generate", "--checkpoint", root, "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    tok = load_tokenizer(hf_dir)
    ids = tok.encode("def ")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == tok.eos_id:
                break
    for _ in range(2):
        assert main(args) == 0 and capsys.readouterr().out == tok.decode(ids) + "\n"
    sampled = ["generate", "--checkpoint", root, "--prompt", "import ", "--max-new-tokens", "16", "--seed", "3"]
    assert main(sampled) == 0
    a = capsys.readouterr().out
    assert main(sampled) == 0 and capsys.readouterr().out == a and a.startswith("import ") and len(a) > len("import \n")


def test_bad_input_exits_2_and_writes_nothing(run, hf_dir, tmp_path, capsys):
    def fails(*argv: str, says: str) -> None:
        assert main(list(argv)) == 2
        assert says in capsys.readouterr().err

    fails("export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "a"), says="no checkpoint")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    fails("export", "--checkpoint", str(run / "checkpoints"), "--out", str(busy), says="not empty")
    assert os.listdir(busy) == ["keep.txt"]
    fails("import", str(tmp_path / "none"), "--out", str(tmp_path / "b"), *DATA, says="no config.json")
    for change, says in (({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not a Llama"),
                         ({"attention_bias": True}, "attention_bias"),
                         ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None},
                          "rope scaling")):
        bad = tmp_path / f"bad-{len(os.listdir(tmp_path))}"
        bad.mkdir()
        conf = json.loads((hf_dir / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**conf, **change}))
        os.symlink(hf_dir / "model.safetensors", bad / "model.safetensors")
        fails("import", str(bad), "--out", str(tmp_path / "c"), *DATA, says=says)
    fails("import", str(hf_dir), "--out", str(busy), *DATA, says="not empty")
    fails("import", str(hf_dir), "--out", str(tmp_path / "d"), "--model.dim=64", *DATA, says="shape")
    fails("import", str(hf_dir), "--out", str(tmp_path / "e"), "--checkpoint.resume=auto2", *DATA,
          says="checkpoint.resume")
    fails("generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", says="no checkpoint")
    fails("generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "x", "--temperature", "-1",
          says="--temperature")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["busy"] + [n for n in left if n.startswith("bad-")])
    assert not [p for p in run.parent.iterdir() if ".tmp" in p.name]
