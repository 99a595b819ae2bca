"""``meshtrain export | import`` of mixture-of-experts models: every meshtrain MoE config a
transformers class computes exactly is exported as that class, which loads with no missing or
unexpected weights and gives meshtrain's logits (fp32, 1e-5) and greedy tokens; its routers pick
meshtrain's experts; imported back the tensors are bitwise the same, and the import trains under
dp2 x ep2 from the model's own loss. Configs no class represents exit 2 naming the field and
write nothing; so do HF settings meshtrain's MoE layer cannot compute.

The meshtrain models are built here (``moe-test`` variants, every weight and routing bias
perturbed so a wrong mapping shows) and saved with meshtrain's checkpoint API; the reference is
the saved model itself.
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
from safetensors.torch import load_file, save_file
import transformers  # the dev extra installs it; meshtrain export itself does not need it

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.mesh import Mesh
from meshtrain.models.llama import PRESETS, Llama
from meshtrain.models.moe import moe_layers
from meshtrain.parallel.parallel_model import ParallelModel, unwrap
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.train.checkpoint import save_checkpoint
from meshtrain.train.checkpoint_io import CheckpointReader
from meshtrain.train.config import Config, DataSection, to_dict
from meshtrain.train.generate import generate_ids
from meshtrain.train.hf import read_hf
from meshtrain.train.loader import GlobalBatchLoader
from meshtrain.train.tokenizer import prepare_data

DATA = ["--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4", "--train.seq_len=32",
        "--no-progress", "--comm.transport=local"]
BASE = dataclasses.replace(PRESETS["moe-test"], vocab_size=512)  # 8 experts (top 2) of 32, 1 shared, layer 0 dense

# name: (LlamaConfig changes, the class it exports as)
VARIANTS = {
    "mixtral": (dict(n_shared_experts=0, first_dense_layers=0), "MixtralForCausalLM"),
    "qwen2-moe": ({}, "Qwen2MoeForCausalLM"),
    "qwen2-moe-unnormalised-tied": (dict(n_shared_experts=0, route_norm=False, tie_embeddings=True),
                                    "Qwen2MoeForCausalLM"),
    "ernie-biased": (dict(n_shared_experts=2, bias_update_rate=0.01), "Ernie4_5_MoeForCausalLM"),
    "glm4-moe": (dict(router_score="sigmoid", route_scale=2.5, bias_update_rate=0.01, first_dense_layers=2),
                 "Glm4MoeForCausalLM"),
    "glm4-moe-bare": (dict(router_score="sigmoid", n_shared_experts=0, first_dense_layers=0, route_norm=False),
                      "Glm4MoeForCausalLM"),
}


def _config(cfg) -> Config:
    """A run config whose model is ``cfg`` and whose corpus is absent (no tokenizer is exported)."""
    config = Config()
    config.model.preset, config.parallel.dp, config.data.path = "moe-test", 1, "/nonexistent/corpus.txt"
    for f in dataclasses.fields(cfg):
        setattr(config.model, f.name, getattr(cfg, f.name))
    return config


def _save(rank: int, cfg, root: str, seed: int) -> Llama:
    model = ParallelModel(cfg, Mesh(dp=1, tp=1), ParallelConfig(), seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for _, p in model.named_parameters():  # norms start at one: perturb everything
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if cfg.bias_update_rate:  # a trained routing bias, large enough to change choices
            for _, layer in moe_layers(unwrap(model.stages[0])):
                layer.router.expert_bias.copy_(torch.randn(cfg.n_experts, generator=g) * 0.05)
    save_checkpoint(root, 3, model, None, extra={"config": to_dict(_config(cfg))})
    return unwrap(model.stages[0]).eval()


def _checkpoint(root: Path, cfg, seed: int = 1) -> Llama:
    """Save a perturbed ``cfg`` model as ``root/step-00000003``; return it (the reference)."""
    return comm.run_local(1, _save, cfg, str(root), seed)[0]


def _model_tensors(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(str(path)) as r:
        return {k: r.read(k, [(0, n) for n in r.global_shape(k)]) for k in r.keys("model/")}


def _load_hf(hf_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    return model.eval()


# a class without shared experts gets a zero-width one, whose construction torch remarks on
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_is_exact_and_imports_back_bitwise(name, tmp_path, capsys):
    changes, arch = VARIANTS[name]
    cfg = dataclasses.replace(BASE, **changes)
    ref = _checkpoint(tmp_path / "ck", cfg)
    hf_dir = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(hf_dir)]) == 0
    assert f"({arch})" in capsys.readouterr().out
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == [arch]
    hf = _load_hf(hf_dir)
    assert type(hf).__name__ == arch

    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ref(tokens)).abs().max().item() < 1e-5
        # each MoE layer's router picks meshtrain's experts with meshtrain's weights
        x = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(1))
        for i in range(cfg.first_dense_layers, cfg.n_layers):
            _, hf_w, hf_idx = hf.model.layers[i].mlp.gate(x)
            route = ref.layers[str(i)].mlp.router(x)
            hf_idx, order = hf_idx.sort(-1)
            assert torch.equal(hf_idx, route.expert_idx.sort(-1).values)
            want_w = route.weights.gather(1, route.expert_idx.sort(-1).indices)
            torch.testing.assert_close(hf_w.gather(1, order), want_w, rtol=1e-6, atol=1e-7)
        i = cfg.first_dense_layers
        block, shared = hf.model.layers[i].mlp, ref.layers[str(i)].mlp.shared
        if arch == "Qwen2MoeForCausalLM":  # sigmoid(zero gate) = 1/2 times the doubled projection: bitwise
            got = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            assert torch.equal(got, shared(x) if shared is not None else torch.zeros_like(x))
        elif cfg.n_shared_experts == 0 and hasattr(block, "shared_experts"):  # a zero-width shared expert adds 0
            assert block.shared_experts.down_proj.weight.shape == (cfg.dim, 0)
            assert torch.equal(block.shared_experts(x), torch.zeros_like(x))

    prompt = tokens[0, :5].tolist()
    want = generate_ids(ref, prompt, 8, temperature=0)
    got = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert got[0].tolist() == want and len(want) == 13

    # the names and layout are those transformers' own save_pretrained writes
    hf.save_pretrained(str(tmp_path / "resaved"))
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as a, \
            safe_open(str(tmp_path / "resaved" / "model.safetensors"), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
    # and back: the same config and, bitwise, the same tensors (routing bias included)
    cfg_back, tensors = read_hf(hf_dir)
    original = {k.removeprefix("model/"): v for k, v in _model_tensors(tmp_path / "ck" / "step-00000003").items()}
    assert tensors.keys() == original.keys()
    assert all(torch.equal(tensors[k], original[k]) for k in original)
    same = {"bias_update_rate": 0.0, **({"ffn_dim": cfg.moe_ffn_dim} if arch == "MixtralForCausalLM" else {})}
    assert cfg_back == dataclasses.replace(cfg, **same)  # training-only / unused fields aside


def test_import_reads_the_fused_layout_too(tmp_path):
    """transformers 5.x can also save its in-memory layout (gate_up_proj [E, 2I, H], gate rows first)."""
    cfg = dataclasses.replace(BASE, n_shared_experts=0, first_dense_layers=0)
    _checkpoint(tmp_path / "ck", cfg)
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    _load_hf(tmp_path / "hf").save_pretrained(str(tmp_path / "fused"), save_original_format=False)
    keys = set(load_file(str(tmp_path / "fused" / "model.safetensors")))
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    _, a = read_hf(tmp_path / "hf")
    _, b = read_hf(tmp_path / "fused")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_imported_moe_trains_under_dp2_ep2_from_its_own_loss(tmp_path, capsys):
    changes, _ = VARIANTS["glm4-moe"]
    cfg = dataclasses.replace(BASE, **changes)
    ref = _checkpoint(tmp_path / "ck", cfg)
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "run"
    # balancing settings are the run's own: an import may change them
    assert main(["import", str(tmp_path / "hf"), "--out", str(out), "--train.steps=1", "--train.warmup_steps=1",
                 "--parallel.dp=2", "--parallel.tp=1", "--parallel.ep=2", "--model.bias_update_rate=0.001",
                 "--model.aux_loss_coef=0.01", *DATA]) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    _, _, tokens = prepare_data(DataSection(vocab_size=512, max_bytes=300000))
    batch = GlobalBatchLoader(tokens, 32, 4, seed=0).next_batch()
    with torch.no_grad():
        want = F.cross_entropy(ref(batch.inputs).flatten(0, 1), batch.targets.flatten()).item()
    assert row["samples"] == batch.sample_ids and row["loss"] == pytest.approx(want, rel=1e-5)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    # the step-0 checkpoint holds the exported tensors bitwise
    back = _model_tensors(out / "checkpoints" / "step-00000000")
    original = _model_tensors(tmp_path / "ck" / "step-00000003")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)


# (LlamaConfig changes, what the error names)
REFUSED = {
    "softmax-scaled": (dict(route_scale=2.0), "route_scale = 2.0"),
    "softmax-biased-unnormalised": (dict(route_norm=False, bias_update_rate=0.01), "route_norm = false"),
    "sigmoid-one-expert": (dict(router_score="sigmoid", n_experts=1, moe_top_k=1), "n_experts = 1"),
}


def test_configs_no_class_represents_exit_2_and_write_nothing(tmp_path, capsys):
    for name, (changes, says) in REFUSED.items():
        _checkpoint(tmp_path / name, dataclasses.replace(BASE, **changes))
        out = tmp_path / f"{name}-hf"
        assert main(["export", "--checkpoint", str(tmp_path / name), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and "no exact transformers class" in err, err
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name or p.name.endswith("-hf")]


def test_hf_settings_meshtrain_cannot_compute_are_refused(tmp_path, capsys):
    """config.json settings (and a gated Qwen2-MoE shared expert) that meshtrain's MoE layer cannot
    compute exactly: the import exits 2 naming them and writes nothing."""
    for name, changes in (("qwen2-moe", {}), ("glm4-moe", VARIANTS["glm4-moe"][0]),
                          ("mixtral", VARIANTS["mixtral"][0])):
        _checkpoint(tmp_path / f"ck-{name}", dataclasses.replace(BASE, **changes))
        assert main(["export", "--checkpoint", str(tmp_path / f"ck-{name}"), "--out", str(tmp_path / name)]) == 0
    cases = [("qwen2-moe", {"qkv_bias": True}, "qkv_bias"),
             ("qwen2-moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
             ("glm4-moe", {"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}},
              "partial_rotary_factor = 0.5"),
             ("glm4-moe", {"n_group": 2, "topk_group": 1}, "group-limited routing"),
             ("glm4-moe", {"use_qk_norm": True}, "use_qk_norm"),
             ("mixtral", {"sliding_window": 16}, "sliding_window")]
    for i, (src, change, says) in enumerate(cases):
        bad = tmp_path / f"bad-{i}"
        bad.mkdir()
        conf = json.loads((tmp_path / src / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**conf, **change}))
        os.symlink(tmp_path / src / "model.safetensors", bad / "model.safetensors")
        assert main(["import", str(bad), "--out", str(tmp_path / "never"), "--convert-only", *DATA]) == 2
        assert says in capsys.readouterr().err
    gated = tmp_path / "gated"
    gated.mkdir()
    (gated / "config.json").write_text((tmp_path / "qwen2-moe" / "config.json").read_text())
    state = load_file(str(tmp_path / "qwen2-moe" / "model.safetensors"))
    state["model.layers.2.mlp.shared_expert_gate.weight"] = torch.full_like(
        state["model.layers.2.mlp.shared_expert_gate.weight"], 0.1)
    save_file(state, str(gated / "model.safetensors"))
    assert main(["import", str(gated), "--out", str(tmp_path / "never"), "--convert-only", *DATA]) == 2
    assert "shared_expert_gate" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
