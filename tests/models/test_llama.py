"""The Llama decoder: shapes, causality, rotary positions, config checks, presets."""

from __future__ import annotations

import pytest
import torch

from meshtrain.models.llama import PRESETS, Llama, LlamaConfig, init_weights, num_params


def _model(**kw) -> Llama:
    m = Llama(LlamaConfig(**{**vars(PRESETS["test"]), **kw}))
    init_weights(m, seed=0)
    return m


def test_logits_shape_and_causality():
    m = _model()
    x = torch.randint(0, 256, (2, 12))
    y = m(x)
    assert y.shape == (2, 12, 256)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % 256  # changing the future must not change the past
    y2 = m(x2)
    torch.testing.assert_close(y[:, :8], y2[:, :8])
    assert not torch.allclose(y[:, 8:], y2[:, 8:])


def test_positions_are_global():
    m = _model()
    x = torch.randint(0, 256, (1, 6))
    # the default positions equal explicit 0..5, and shifted positions change the result
    torch.testing.assert_close(m(x), m(x, torch.arange(6)))
    assert not torch.allclose(m(x), m(x, torch.arange(6) + 10))


def test_same_seed_same_weights_and_tied_head():
    a, b = _model(), _model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    t = _model(tie_embeddings=True)
    assert t.head.weight is t.tok_emb.weight
    assert num_params(t) == num_params(a) - t.cfg.vocab_size * t.cfg.dim


def test_bad_config_and_too_long_input():
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(torch.zeros(1, 129, dtype=torch.long))


def test_preset_sizes():
    assert 0.5e6 < num_params(Llama(PRESETS["test"])) < 1.5e6
    assert 4.5e6 < num_params(Llama(PRESETS["5m"])) < 5.5e6
    assert 8e6 < num_params(Llama(PRESETS["10m"])) < 15e6
    with torch.device("meta"):  # the planning shapes, without allocating them
        assert 1.1e9 < num_params(Llama(PRESETS["1b"])) < 1.4e9
        assert 7.5e9 < num_params(Llama(PRESETS["8b"])) < 8.5e9


def test_init_depends_on_seed_and_name_only():
    """A split parameter (its ``placement``: slice 1 of 2 along dim 0) gets exactly its slice of the full init, and a
    stage holding only some layers gets the same values for them as the whole model."""
    from meshtrain.models.llama import full_value
    from meshtrain.placement import Placement

    full = _model()
    with torch.device("meta"):
        part = Llama(full.cfg)
    del part.layers["0"], part.layers["1"]
    part.tok_emb = None
    part.to_empty(device="cpu")
    with torch.no_grad():
        part.layers["2"].attn.wq.weight.data = torch.empty(full.cfg.dim // 2, full.cfg.dim)
    # pretend: the second half of the rows
    part.layers["2"].attn.wq.weight.placement = Placement.split((full.cfg.dim // 2, full.cfg.dim), "tp", 0, 1, 2)
    init_weights(part, seed=0)
    want = dict(full.named_parameters())
    for name, p in part.named_parameters():
        if name == "layers.2.attn.wq.weight":
            torch.testing.assert_close(p, want[name][full.cfg.dim // 2 :], rtol=0, atol=0)
        else:
            torch.testing.assert_close(p, want[name], rtol=0, atol=0)
    assert not torch.equal(full_value("layers.2.attn.wq.weight", (4, 4), full.cfg, seed=0),
                           full_value("layers.2.attn.wq.weight", (4, 4), full.cfg, seed=1))
