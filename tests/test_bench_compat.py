"""``meshtrain bench compat``: bad input exits 2; a tiny run trains the same weights three ways
(torch.distributed over gloo, meshtrain.comm on the torch and on the shm transport)."""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("argv,fragment", [
    (["--width", "0"], "--width must be >= 1"),
    (["--trials", "0"], "--trials must be >= 1"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    assert main(["bench", "compat", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_tiny_run_trains_the_same_weights_three_ways(tmp_path, capsys):
    out = tmp_path / "compat.json"
    assert main(["bench", "compat", "--width", "32", "--batch", "4", "--steps", "2", "--warmup", "1",
                 "--trials", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["same_weights"] is True
    assert set(got["ratio"]) == {"torch-gloo", "meshtrain-torch", "meshtrain-shm"}
    for mode, ratio in got["ratio"].items():
        assert ratio == pytest.approx(got["step_s"]["torch-gloo"] / got["step_s"][mode])
    assert "final weights equal in all three: True" in capsys.readouterr().out


# ------------------------------------------------------------------ --layouts: the 4D Llama


def _reference(cfg, steps):
    """The same Llama trained in one process with plain PyTorch (no dist, no micro-batches, SDPA
    attention): its losses and final weights."""
    import torch
    import torch.nn.functional as F

    from meshtrain.bench import compat_llama as L

    p = {n: L.full_weight(cfg, n).requires_grad_() for n in L.stage_names(cfg, 0, 1)}
    opt = torch.optim.SGD(list(p.values()), lr=cfg.lr)
    rope, hd = L.rope_tables(cfg), cfg.dim // cfg.heads
    losses = []
    for step in range(steps):
        tok = L.global_tokens(cfg, step)
        x, y = tok[:, :-1], tok[:, 1:]
        b, n = x.shape
        h = F.embedding(x, p["embed"])
        for layer in range(cfg.layers):
            w = {k.rsplit(".", 1)[1]: v for k, v in p.items() if k.startswith(f"layers.{layer}.")}
            a = L.rms_norm(h, w["attn_norm"], cfg.eps)
            q, k, v = (F.linear(a, w[m]).view(b, n, cfg.heads, hd) for m in ("wq", "wk", "wv"))
            q, k = L.apply_rope(q, *rope), L.apply_rope(k, *rope)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            h = h + F.linear(o.transpose(1, 2).reshape(b, n, cfg.dim), w["wo"])
            m = L.rms_norm(h, w["mlp_norm"], cfg.eps)
            h = h + F.linear(F.silu(F.linear(m, w["w_gate"])) * F.linear(m, w["w_up"]), w["w_down"])
        loss = F.cross_entropy(F.linear(L.rms_norm(h, p["norm"], cfg.eps), p["lm_head"]).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in p.items()}


def _tiny():
    from meshtrain.bench.compat_llama import LlamaConfig

    return LlamaConfig(vocab=64, dim=32, heads=4, layers=2, ffn=64, seq=16, global_batch=8, micro_batches=2)


@pytest.fixture(scope="module")
def reference():
    return _reference(_tiny(), 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["dp4", "pp2xdp2", "tp2xdp2", "cp2xdp2", "cp4", "tp2xcp2xpp2"])
def test_layout_trains_the_plain_pytorch_model(layout, reference):
    """TP, ring-attention CP, 1F1B PP and DP (on meshtrain.comm's threads) give the single-process
    model's losses and weight updates, step by step."""
    import meshtrain.comm as mc
    from meshtrain.bench import compat_llama as L

    cfg, sizes = _tiny(), L.parse_layout(layout)
    ref_losses, ref_params = reference
    got = mc.run_local(L.world_size(sizes), lambda r: L.loop(mc, r, sizes if r == 0 else None,
                                                              cfg if r == 0 else None, 2, 0, return_params=True))
    for out in got:  # every rank knows the global loss
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5)
    seen = set()
    for rank, out in enumerate(got):
        tp_rank = rank % sizes["tp"]
        for name, w in out["params"].items():
            w0 = L.shard(name, L.full_weight(cfg, name), tp_rank, sizes["tp"])
            want = L.shard(name, ref_params[name], tp_rank, sizes["tp"]) - w0
            assert want.abs().max() > 0, name
            assert (w - w0 - want).abs().max() <= 1e-4 * want.abs().max(), (rank, name)
            seen.add(name)
    assert seen == set(L.stage_names(cfg, 0, 1))  # the stages' weights make the whole model


@pytest.mark.parametrize("argv,fragment", [
    (["--layouts", "dq4"], "'dq4' is not one of dpN, tpN, cpN, ppN"),
    (["--layouts", "dp0"], "'dp0' is not one of"),
    (["--layouts", "dp2"], "multiply to 2, not the world size 4"),
    (["--layouts", "dp2xdp2"], "dp appears twice"),
    (["--layouts", "dp4,dp4"], "dp4 is given twice"),
    (["--layouts", ","], "--layouts is empty"),
    (["--layouts", "tp8", "--world", "8"], "heads (4) must be divisible by tp (8)"),
    (["--layouts", "dp4", "--world", "0"], "--world must be >= 1"),
    (["--layouts", "dp4", "--hosts", "3"], "--hosts must be >= 1 and divide --world 4, got 3"),
    (["--layouts", "dp4", "--hosts", "0"], "--hosts must be >= 1 and divide --world 4, got 0"),
    (["--layouts", "dp4", "--hosts", "2", "--floor"], "--floor runs on one host only"),
])
def test_bad_layouts_exit_2(argv, fragment, capsys):
    assert main(["bench", "compat", *argv]) == 2
    err = capsys.readouterr().err
    assert "meshtrain bench compat: error: " in err and fragment in err


def test_layouts_run_torch_and_meshtrain_processes(tmp_path, capsys, monkeypatch):
    """End to end on real processes: torch.distributed (gloo) and meshtrain.comm train the same
    pp2 x cp2 Llama, bitwise (every sum has 2 members), and the table and JSON say so; --floor runs
    the loop a third time with communication that costs nothing (and whose losses are not compared)."""
    from meshtrain.bench import compat

    monkeypatch.setattr(compat, "LLAMA_CONFIG", _tiny())
    out = tmp_path / "llama.json"
    assert main(["bench", "compat", "--layouts", "pp2xcp2", "--steps", "2", "--warmup", "1", "--trials", "1",
                 "--json", str(out), "--floor"]) == 0
    got = json.loads(out.read_text())["layouts"]["pp2xcp2"]
    assert got["bitwise_equal"] is True and got["ok"] is True and got["max_reduction"] == 2
    assert got["ratio"] == pytest.approx(got["step_s"]["meshtrain"] / got["step_s"]["torch-gloo"])
    assert len(got["losses"]["meshtrain"][0]) == 3
    assert all(got["comm_s"][m] > 0 for m in ("torch-gloo", "meshtrain"))  # p2p waits and all-reduces timed
    # the floor waits for nobody: its time inside communication calls is a small part of theirs
    assert got["comm_s"]["floor"] < 0.2 * min(got["comm_s"][m] for m in ("torch-gloo", "meshtrain"))
    assert got["floor_ratio"] == pytest.approx(got["step_s"]["floor"] / got["step_s"]["torch-gloo"])
    assert set(got["losses"]) == {"torch-gloo", "meshtrain"}
    text = capsys.readouterr().out
    assert "pp2xcp2" in text and "floor (communication free)" in text


def test_comm_clock_times_calls_and_waits_and_keeps_the_module_names():
    """The clock adds the time inside timed calls and inside waits on the Works they return; the
    other names are the module's own objects (P2POp checks isend/irecv by identity)."""
    import time
    import types

    import torch.distributed as tdist

    from meshtrain.bench.comm_clock import CommClock

    class Work:
        def wait(self):
            time.sleep(0.02)

    fake = types.SimpleNamespace(all_reduce=lambda t, group=None: time.sleep(0.03), isend=tdist.isend,
                                 batch_isend_irecv=lambda ops: [Work() for _ in ops], ReduceOp=tdist.ReduceOp)
    clock = CommClock(fake)
    assert clock.isend is tdist.isend and clock.ReduceOp is tdist.ReduceOp
    t0 = time.perf_counter()
    clock.all_reduce(None)
    for w in clock.batch_isend_irecv([1, 2]):
        w.wait()
    outside = time.perf_counter() - t0
    assert 0.07 <= clock.seconds <= outside
    clock.reset()
    assert clock.seconds == 0.0


def test_layouts_exit_1_when_losses_differ_more_than_allowed(monkeypatch, capsys):
    """Exit 1 if a layout whose sums all have <= 2 members is not bitwise equal, or any layout
    differs by more than 1e-5 relative; a last-bit difference of a 4-member sum passes."""
    from meshtrain.bench import compat

    def fake(rel, widest):
        return {"step_s": {"torch-gloo": 0.1, "meshtrain": 0.1}, "trials_step_s": {"torch-gloo": [0.1],
                "meshtrain": [0.1]}, "ratio": 1.0, "comm_s": {"torch-gloo": 0.05, "meshtrain": 0.01},
                "bitwise_equal": rel == 0.0, "max_rel_diff": rel,
                "max_reduction": widest, "ok": compat.losses_agree(rel, widest)}

    for name, rel, widest, code in [("dp4", 7e-8, 4, 0), ("pp2xdp2", 0.0, 2, 0), ("pp2xdp2", 7e-8, 2, 1),
                                    ("dp4", 2e-5, 4, 1), ("dp4", float("nan"), 4, 1)]:
        monkeypatch.setattr(compat, "run_layouts", lambda *a, r={name: fake(rel, widest)}: r)
        assert main(["bench", "compat", "--layouts", name]) == code
        assert ("(FAIL)" in capsys.readouterr().out) == bool(code)
