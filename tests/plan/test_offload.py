"""ZeRO CPU offload in ``meshtrain plan`` (``meshtrain/plan/offload.py``): the device memory drops by
the masters and AdamW state (and, with "params", ZeRO-3's shard), which the host holds instead; the
step time changes by the CPU optimizer's time against the GPU's plus the modelled PCIe time; the
``--offload`` flag and the ``offload=`` layout key; the rules meshtrain train has."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.plan.architectures import resolve_model
from meshtrain.plan.clusters import PRESETS
from meshtrain.plan.layout import parse_layout
from meshtrain.plan.memory import sharded
from meshtrain.plan import step
from meshtrain.plan.step import predict

H100 = PRESETS["h100"]
ARCH = resolve_model("8b")
BATCH, SEQ = 8, 4096


def _pair(text: str, offload: str):
    base = parse_layout(text)
    return predict(ARCH, H100, base, BATCH, SEQ), predict(ARCH, H100, replace(base, offload=offload), BATCH, SEQ)


@pytest.mark.parametrize("text, offload", [("dp=1,m=8,zero=1,ac=full", "optimizer"),
                                           ("dp=8,m=1,zero=3,ac=full", "optimizer"),
                                           ("dp=8,m=1,zero=3,ac=full", "params")])
def test_device_memory_drops_by_what_moves_and_time_rises_by_the_modelled_pcie(text, offload):
    plain, off = _pair(text, offload)
    layout = off.layout
    shard = sharded(ARCH, layout, 1.0, 1)  # parameters of this rank's optimizer shard
    held = sharded(ARCH, layout, 1.0, 3)  # parameters whose weights the rank keeps
    # the masters (4 B) and AdamW's moments (8 B) leave the device; the weights stay in bf16 (2 B),
    # or leave too with "params"; the host holds masters, moments and the gradient's staging (4 B)
    kept = 0.0 if offload == "params" else 2 * held
    before = plain.memory.params + plain.memory.optimizer + (plain.memory.buffers if layout.zero_stage < 3 else 0)
    assert plain.memory.total - off.memory.total == pytest.approx(before - kept)
    assert off.memory.optimizer == 0 and off.memory.host == pytest.approx(16 * shard)
    assert off.memory.grads == plain.memory.grads and off.memory.activations == plain.memory.activations
    # time: the update moves to the node's CPUs (one rank per node here: dp=1; or 8 sharing one)
    ranks = min(layout.world, H100.gpus_per_node)
    cpu = shard / (H100.host_adam_rate / ranks)
    assert off.parts["optimizer"] == pytest.approx(cpu)
    d2h = h2d = 4 * shard / H100.pcie_bandwidth  # fp32 gradient down, fp32 master up, per step
    # ZeRO's units, filled and drained one at a time: blocks and the root (ZeRO-3), buckets (ZeRO-1/2)
    units = ARCH.n_layers + 1 if layout.zero_stage == 3 else step.gradient_buckets(ARCH, H100, layout)[0].count
    if offload == "params":
        h2d = 0.0
    pcie = max(cpu, d2h, h2d) - cpu + (d2h + h2d) / units
    if offload == "params":  # every ZeRO-3 gather copies the shard first: forward and backward
        pcie += 2 * layout.microbatches * 4 * shard / H100.pcie_bandwidth
    assert off.parts["pcie"] == pytest.approx(pcie) and pcie > 0
    rise = off.parts["optimizer"] - plain.parts["optimizer"] + off.parts["pcie"]
    assert off.step_time - plain.step_time == pytest.approx(rise)
    assert {k: v for k, v in off.parts.items() if k not in ("optimizer", "pcie")} == \
        {k: v for k, v in plain.parts.items() if k not in ("optimizer", "pcie")}


def test_one_h100_fits_the_8b_preset_only_with_optimizer_offload():
    plain, off = _pair("dp=1,m=8,zero=1,ac=full", "optimizer")
    assert not plain.fits and off.fits and off.memory.host <= off.host_capacity
    assert off.as_dict()["memory_bytes"]["host"] == off.memory.host


def test_the_flag_the_layout_key_and_the_rules(capsys):
    args = ["plan", "--model", "8b", "--cluster", "h100", "--gpus", "1", "--global-batch", "8", "--seq", "4096",
            "--json"]
    assert main([*args, "--layout", "dp=1,m=8,zero=1,ac=full", "--offload", "optimizer"]) == 0
    got = json.loads(capsys.readouterr().out)["layouts"][0]
    assert got["layout"] == "dp=1,tp=1,pp=1,cp=1,m=8,zero=1,offload=optimizer,ac=full" and got["fits"]
    assert parse_layout(got["layout"]).offload == "optimizer"
    # the search on one GPU tries ZeRO when offload needs it ("params": stage 3 only)
    assert main([*args, "--search", "--offload", "params", "--top", "2"]) == 0
    assert all("zero=3,offload=params" in p["layout"] for p in json.loads(capsys.readouterr().out)["layouts"])
    for text, needle in (("dp=1,offload=optimizer", "offload = 'optimizer' needs ZeRO"),
                         ("dp=1,zero=2,offload=params", "offload = 'params' needs zero = 3"),
                         ("dp=1,zero=1,offload=nvme", "offload = 'nvme' is not one of none, optimizer, params")):
        with pytest.raises(ConfigError, match=needle):
            predict(ARCH, H100, parse_layout(text), BATCH, SEQ)
