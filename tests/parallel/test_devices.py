"""The same checks on every device: collectives on the thread transport, training parity against
plain PyTorch (fp32 and bf16 autocast) for one rank, dp2 and tp2, and in fp32 for pp2 and ZeRO-3
over dp2 (several ranks sharing one GPU as threads), and a checkpoint round trip. On a machine without CUDA the ``cuda`` cases skip with
the reason (``make gpu-check`` runs them on a GPU); the ``cpu`` cases always run, and so do the
``cpu-as-accelerator`` ones: CPU tensors through the branches and threads of a device run
(``tests/_accelerator.py``), which is how CPU CI sees the bugs that only a GPU used to find."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from meshtrain import comm

from .._accelerator import as_accelerator
from ._parity import CFG, LR, batches

ACCELERATOR = "cpu-as-accelerator"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda), ACCELERATOR]
STEPS = 3
# bf16 autocast: sharded layouts round partial sums differently; fp32: reduction order only
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def _device(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The torch device a case runs on; the accelerator double runs on the CPU."""
    if name == ACCELERATOR:
        as_accelerator(monkeypatch)
        return "cpu"
    return name


@pytest.mark.parametrize("device", DEVICES)
def test_collectives_on_the_device(device, monkeypatch):
    device = _device(device, monkeypatch)

    def fn(rank):
        x = torch.arange(8, dtype=torch.float32, device=device) + 10 * rank
        out = {}
        a = x.clone()
        comm.all_reduce(a)
        out["all_reduce"] = a
        g = torch.empty(16, device=device)
        comm.all_gather_into_tensor(g, x)
        out["all_gather"] = g
        r = torch.empty(4, device=device)
        comm.reduce_scatter_tensor(r, x)
        out["reduce_scatter"] = r
        b = x.clone()
        comm.broadcast(b, src=1)
        out["broadcast"] = b
        t = torch.empty(8, device=device)
        comm.all_to_all_single(t, x)
        out["all_to_all"] = t
        assert all(v.device.type == device for v in out.values())
        return {k: v.cpu() for k, v in out.items()}

    res = comm.run_local(2, fn, timeout=60)
    xs = [torch.arange(8, dtype=torch.float32) + 10 * r for r in range(2)]
    for rank, got in enumerate(res):
        assert torch.equal(got["all_reduce"], xs[0] + xs[1])
        assert torch.equal(got["all_gather"], torch.cat(xs))
        assert torch.equal(got["reduce_scatter"], (xs[0] + xs[1])[4 * rank : 4 * rank + 4])
        assert torch.equal(got["broadcast"], xs[1])
        assert torch.equal(got["all_to_all"], torch.cat([xs[0][4 * rank : 4 * rank + 4], xs[1][4 * rank : 4 * rank + 4]]))


def _plain(device: str, precision: str) -> list[float]:
    """Plain PyTorch on ``device``: the reference losses."""
    from meshtrain.models.llama import Llama, init_weights

    with torch.device(device):
        model = Llama(CFG)
    init_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for d in batches(STEPS):
        d = d.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(d[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), d[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _meshtrain(rank: int, layout: dict, device: str, precision: str, **settings) -> list[float]:
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.parallel.parallelize import ParallelConfig

    pc = ParallelConfig(precision=precision, **settings)
    model = ParallelModel(CFG, Mesh(**layout), pc, seed=0, device=device)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    losses = []
    for d in batches(STEPS):
        d = d.to(device)
        loss = model.forward_backward(d[:, :-1], d[:, 1:])
        assert loss.device.type == device
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_dp2_and_tp2_match_plain_pytorch_on_the_device(device, precision, monkeypatch):
    device = _device(device, monkeypatch)
    want = _plain(device, precision)
    for layout in ({"dp": 1}, {"dp": 2}, {"tp": 2}):
        for got in comm.run_local(math.prod(layout.values()), _meshtrain, layout, device, precision, timeout=120):
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            assert rel <= TOLERANCE[precision], (layout, got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_pp2_and_zero3_match_plain_pytorch_on_the_device(device, monkeypatch):
    """The pipeline engine's messages and ZeRO-3's gathers and reduce-scatters on the device."""
    device = _device(device, monkeypatch)
    want = _plain(device, "fp32")
    for layout, settings in (({"pp": 2}, {"microbatches": 2}), ({"dp": 2}, {"zero_stage": 3})):
        for got in comm.run_local(2, _meshtrain, layout, device, "fp32", timeout=120, **settings):
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            assert rel <= TOLERANCE["fp32"], (layout, settings, got, want)


# Every layout with ranks as threads sharing one GPU (issue 32), against plain PyTorch on the same
# GPU. On CPU the same layouts have their parity tests (test_parity.py); these run in gpu-check.
GPU_LAYOUTS = {
    "dp2xtp2-sp": ({"dp": 2, "tp": 2}, {"sequence_parallel": True}),
    "pp2xcp2-1f1b": ({"pp": 2, "cp": 2}, {"microbatches": 2, "schedule": "1f1b"}),
    "pp2xcp2-interleaved": ({"pp": 2, "cp": 2}, {"microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}),
    "zero1-dp2": ({"dp": 2}, {"zero_stage": 1}),
    "zero2-dp2": ({"dp": 2}, {"zero_stage": 2}),
    "zero3-dp2": ({"dp": 2}, {"zero_stage": 3}),
    "hsdp-zero3": ({"dp": 4, "dp_replicate": 2}, {"zero_stage": 3}),
}


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GPU_LAYOUTS))
def test_every_layout_matches_plain_pytorch_on_one_gpu(name, precision):
    layout, settings = GPU_LAYOUTS[name]
    want = _plain("cuda", precision)
    world = math.prod(v for k, v in layout.items() if k != "dp_replicate")  # dp counts the replicas
    for got in comm.run_local(world, _meshtrain, layout, "cuda", precision, timeout=240, **settings):
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
        assert rel <= TOLERANCE[precision], (name, precision, got, want)


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_nccl_under_torchrun_at_world_one(tmp_path):
    """One rank under torchrun on NCCL (the CUDA-stream and NCCL-native paths of ``auto``): a short
    run of the trainer ends with its metrics, and the loss falls."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "meshtrain.train", f"--out={out}", "--model.preset=test", "--train.steps=6",
                           "--train.global_batch=4", "--train.seq_len=64", "--data.max_bytes=300000",
                           "--data.vocab_size=512", "--comm.backend=nccl", "--comm.transport=torch",
                           "--train.device=cuda", "--checkpoint.enabled=false"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"], rows


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_round_trip_on_the_device(tmp_path, device, monkeypatch):
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.parallel.parallelize import ParallelConfig
    from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint

    device = _device(device, monkeypatch)

    def fn(rank):
        def build(seed):
            model = ParallelModel(CFG, Mesh(dp=2), ParallelConfig(zero_stage=1), seed=seed, device=device)
            return model, model.build_optimizer(torch.optim.AdamW, lr=LR)

        model, opt = build(0)
        d = batches(1)[0].to(device)
        model.forward_backward(d[:, :-1], d[:, 1:])
        opt.step()
        save_checkpoint(str(tmp_path), 1, model, opt)
        other, other_opt = build(1)  # different weights until loaded
        load_checkpoint(str(tmp_path), other, other_opt)
        pairs = zip(model.named_parameters(), other.named_parameters(), strict=True)
        return all(p.device.type == device and torch.equal(p, q) for (_, p), (_, q) in pairs)

    assert comm.run_local(2, fn, timeout=120) == [True, True]


def test_every_host_branch_asks_on_host():
    """A branch on "is this tensor on the CPU" in comm, parallel or bench asks ``comm.device.on_host``,
    so that the accelerator double reaches its device side on CPU CI (issue 32)."""
    import meshtrain

    root = Path(meshtrain.__file__).parent
    found = []
    for pkg in ("comm", "parallel", "bench"):
        for path in sorted((root / pkg).rglob("*.py")):
            if path == root / "comm" / "device.py":  # on_host itself
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                cpu_type = (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                            and node.left.attr == "type"
                            and any(isinstance(c, ast.Constant) and c.value == "cpu" for c in node.comparators))
                if cpu_type or (isinstance(node, ast.Attribute) and node.attr == "is_cpu"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"ask meshtrain.comm.device.on_host instead: {found}"
