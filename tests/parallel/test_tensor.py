"""Tensor and sequence parallel layers against the same computation on full layers, in plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshtrain import comm
from meshtrain.errors import ConfigError
from meshtrain.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       allreduce_sequence_parallel_grads, vocab_parallel_cross_entropy)

B, S, D, H, V = 2, 8, 12, 16, 24


def _full():
    g = torch.Generator().manual_seed(0)
    fc1, fc2 = nn.Linear(D, H), nn.Linear(H, D)
    emb = nn.Embedding(V, D)
    with torch.no_grad():
        for p in list(fc1.parameters()) + list(fc2.parameters()) + list(emb.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(B, S, D, generator=g)
    ids = torch.randint(0, V, (B, S), generator=g)
    return fc1, fc2, emb, x, ids


def _reference():
    fc1, fc2, emb, x, ids = _full()
    x = x.clone().requires_grad_()
    h = emb(ids) + x
    y = fc2(F.gelu(fc1(h)))
    logits = y @ emb.weight.t()  # a tied head, vocab-parallel like the embedding
    loss = F.cross_entropy(logits.reshape(-1, V), ids.roll(1, dims=1).reshape(-1))
    loss.backward()
    return loss.detach(), y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad, fc2.bias.grad, emb.weight.grad


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_embedding_and_vocab_parallel_loss_match_full_layers(tp, sp):
    want = _reference()

    def fn(rank):
        fc1, fc2, emb, x, ids = _full()
        g = comm.current().world
        c1 = ColumnParallelLinear.from_full(fc1, g, sequence_parallel=sp)
        r2 = RowParallelLinear.from_full(fc2, g, sequence_parallel=sp)
        e = VocabParallelEmbedding.from_full(emb, g, sequence_parallel=sp)
        xs = x.chunk(tp, dim=1)[rank] if sp else x
        xs = xs.clone().requires_grad_()
        y = r2(F.gelu(c1(e(ids) + xs)))
        # the head needs the full sequence: leave the sequence-parallel region first
        from meshtrain.parallel.tensor_comm import CopyToTP, GatherFromSP
        yf = GatherFromSP.apply(y, g, 1) if sp else CopyToTP.apply(y, g)
        logits = yf @ e.weight.t()
        loss = vocab_parallel_cross_entropy(logits, ids.roll(1, dims=1), g)
        loss.backward()
        allreduce_sequence_parallel_grads(r2, g)  # the bias saw only this rank's sequence slice
        return loss.detach(), y.detach(), xs.grad, c1.weight.grad, r2.weight.grad, r2.bias.grad, e.weight.grad

    loss, y, xg, w1g, w2g, b2g, eg = want
    for rank, (l, yy, xgr, w1, w2, b2, egr) in enumerate(comm.run_local(tp, fn, timeout=60)):
        torch.testing.assert_close(l, loss)
        torch.testing.assert_close(yy, y.chunk(tp, dim=1)[rank] if sp else y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xgr, xg.chunk(tp, dim=1)[rank] if sp else xg, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(w1, w1g.chunk(tp, dim=0)[rank], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w2, w2g.chunk(tp, dim=1)[rank], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b2, b2g, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(egr, eg.chunk(tp, dim=0)[rank], atol=1e-6, rtol=1e-5)


def test_gather_output_and_full_input_variants():
    fc1, fc2, _, x, _ = _full()
    want = fc2(fc1(x))

    def fn(rank):
        f1, f2, _, xx, _ = _full()
        g = comm.current().world
        c1 = ColumnParallelLinear.from_full(f1, g, gather_output=True)
        r2 = RowParallelLinear.from_full(f2, g, input_is_parallel=False)
        return r2(c1(xx)).detach()

    for y in comm.run_local(2, fn, timeout=30):
        torch.testing.assert_close(y, want.detach(), atol=1e-5, rtol=1e-5)


def test_sizes_that_do_not_divide_by_tp_are_config_errors():
    def fn(rank):
        g = comm.current().world
        with pytest.raises(ConfigError, match="out_features = 10 is not divisible by tp = 4"):
            ColumnParallelLinear(8, 10, g)
        with pytest.raises(ConfigError, match="vocab_size = 30 is not divisible by tp = 4"):
            VocabParallelEmbedding(30, 8, g)
        return True

    assert all(comm.run_local(4, fn, timeout=30))


@pytest.mark.parametrize("sp", [False, True])
def test_a_sub_blocks_column_linears_share_one_collective_on_their_input(sp, monkeypatch):
    # q, k, v read one input, w1 and w3 another: one all-gather (sequence parallel) or one backward
    # all-reduce each, as Megatron and torchtitan do, not one per linear (5 a block before)
    from meshtrain.models.llama import Llama, LlamaConfig
    from meshtrain.parallel import tensor_comm
    from meshtrain.parallel.parallelize import apply_tensor_parallel

    layers, tp = 3, 2
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=32, max_seq_len=16)
    calls: dict[str, int] = {"all_gather": 0, "all_reduce": 0}
    for name in calls:
        real = getattr(tensor_comm, f"_{name}")

        def counted(*args, _real=real, _name=name):
            if comm.current().rank == 0:
                calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(tensor_comm, f"_{name}", counted)

    def fn(rank):
        torch.manual_seed(0)
        model = Llama(cfg)
        apply_tensor_parallel(model, comm.current().world, sequence_parallel=sp)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape) * 0.1)
        model(torch.randint(0, 32, (2, 8))).float().sum().backward()
        return True

    assert all(comm.run_local(tp, fn, timeout=60))
    if sp:  # forward: per block attention + MLP, and the head; backward: the row-parallel outputs' grads, the embedding's
        assert calls["all_gather"] == (2 * layers + 1) + (2 * layers + 1)
    else:  # forward: per block wo, w2, and the embedding; backward: per block attention + MLP, and the head
        assert calls["all_reduce"] == (2 * layers + 1) + (2 * layers + 1)


def test_a_sub_blocks_gathered_input_is_saved_once_for_all_its_linears():
    # with sequence parallelism the gathered input is made contiguous once, so q, k, v (and w1, w3)
    # save the same tensor for their weight gradients instead of a flattened copy each
    from meshtrain.models.llama import Llama, LlamaConfig
    from meshtrain.parallel.parallelize import apply_tensor_parallel

    layers, tokens, dim = 3, 2 * 8, 16
    # widths chosen apart: a rank's q is 8 wide, its MLP hidden 24, its sequence slice 8 tokens
    cfg = LlamaConfig(vocab_size=32, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)

    def fn(rank):
        torch.manual_seed(0)
        model = Llama(cfg)
        apply_tensor_parallel(model, comm.current().world, sequence_parallel=True)
        storages: dict[int, tuple] = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved too: not counted

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = (t.numel() // t.shape[-1], t.shape[-1])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 32, (2, 8)))
        return sum(shape == (tokens, dim) for shape in storages.values())

    # per block the attention's and the MLP's gathered input, and the head's: 2 x layers + 1
    assert comm.run_local(2, fn, timeout=60) == [2 * layers + 1] * 2
