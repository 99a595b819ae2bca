"""Placements: a parameter's box in its global tensor, read by init, clipping and checkpoints."""

from __future__ import annotations

import torch

from meshtrain import comm
from meshtrain.mesh import Mesh
from meshtrain.models.llama import Llama, LlamaConfig, init_weights
from meshtrain.placement import Placement, Split, placement_of

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def test_nested_splits_cut_the_same_slices_as_torch_chunk():
    full = torch.arange(8 * 6.0).view(8, 6)
    for outer in range(2):
        for inner in range(2):
            for col in range(3):
                p = Placement((8, 6), (Split("a", 0, outer, 2), Split("b", 0, inner, 2), Split("c", 1, col, 3)))
                want = full.chunk(2, 0)[outer].chunk(2, 0)[inner].chunk(3, 1)[col]
                assert torch.equal(p.local(full), want)
                assert p.local_shape == tuple(want.shape) and p.sharded_over == {"a", "b", "c"}
                # the local box shifted into the global tensor is where the slice came from
                (r0, r1), (c0, c1) = p.shift(((0, want.shape[0]), (0, want.shape[1])))
                assert torch.equal(full[r0:r1, c0:c1], want)


def test_every_parameter_of_a_tp_model_is_its_placement_slice_of_the_full_init():
    """Under tp2 each rank's parameter equals ``placement.local`` of the one-process parameter
    of the same name, and the split ones are split over tp."""
    full = Llama(CFG)
    init_weights(full, seed=3)
    want = dict(full.named_parameters())

    def fn(rank):
        from meshtrain.parallel.parallel_model import ParallelModel
        from meshtrain.parallel.parallelize import ParallelConfig

        model = ParallelModel(CFG, Mesh(tp=2), ParallelConfig(), seed=3)
        split = []
        for name, p in model.named_parameters():
            pl = placement_of(p)
            assert pl.global_shape == tuple(want[name].shape), name
            assert torch.equal(p.detach(), pl.local(want[name].detach())), name
            if pl.sharded_over:
                assert pl.sharded_over == {"tp"} and p.numel() * 2 == want[name].numel()
                split.append(name)
        return split

    split = comm.run_local(2, fn, timeout=30)[0]
    assert "layers.0.attn.wq.weight" in split and "tok_emb.weight" in split and "head.weight" in split
    assert not any(n.endswith("norm.weight") for n in split)
