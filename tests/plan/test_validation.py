"""``meshtrain plan`` refuses bad input: every numeric flag, every layout key and every field of a
cluster TOML is checked for type and range, and a bad one exits 2 with a message that names it, its
value and the fix, with nothing on stdout. ``--search`` keeps a memory margin, leaves out the layouts
the planner's rules refuse, and warns (stderr) where a layout's tensor parallelism crosses nodes."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from meshtrain.cli import main
from meshtrain.plan.architectures import ARCHS, resolve_model
from meshtrain.plan.clusters import PRESETS, Cluster, resolve_cluster
from meshtrain.plan.layout import parse_layout
from meshtrain.plan.search import search

search_module = sys.modules["meshtrain.plan.search"]  # the package's ``search`` attribute is the function
from meshtrain.plan.step import predict

BASE = ["plan", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "16", "--global-batch", "32", "--seq", "4096"]


def _with(flag: str, value: str, argv: list[str] | None = None) -> list[str]:
    """BASE with ``flag`` set to ``value`` (replacing it where BASE has it)."""
    argv = list(argv or BASE)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return argv + [flag, value]


L = ["--layout", "dp=16"]
FLAGS = [  # (id, argv, what stderr must name)
    ("negative batch", _with("--global-batch", "-16") + L, "--global-batch -16: must be a whole number from 1"),
    ("negative batch, search", _with("--global-batch", "-16") + ["--search"], "--global-batch -16"),
    ("zero batch", _with("--global-batch", "0") + L, "--global-batch 0"),
    ("zero seq", _with("--seq", "0") + L, "--seq 0: must be a whole number from 1"),
    ("negative seq", _with("--seq", "-8192") + L, "--seq -8192"),
    ("negative seq, search", _with("--seq", "-8192") + ["--search"], "--seq -8192"),
    ("huge seq", _with("--seq", str(2**30)) + L, "--seq 1073741824"),
    ("fractional seq", _with("--seq", "4096.5") + L, "argument --seq: '4096.5' is not a whole number"),
    ("zero gpus", _with("--gpus", "0") + L, "--gpus 0: must be a whole number from 1"),
    ("negative gpus, search", _with("--gpus", "-8") + ["--search"], "--gpus -8"),
    ("huge gpus, search", _with("--gpus", str(2**40)) + ["--search"], f"--gpus {2**40}"),
    ("text gpus", _with("--gpus", "x") + L, "argument --gpus: 'x' is not a whole number"),
    ("partial node", _with("--gpus", "12") + ["--layout", "dp=12"], "--gpus 12 is 1.5 nodes of 8 GPUs"),
    ("partial node, search", _with("--gpus", "12") + ["--search"], "use --gpus 8 or 16"),
    ("zero top", BASE + ["--search", "--top", "0"], "--top 0: must be a whole number >= 1"),
    ("negative top with a layout", BASE + L + ["--top", "-1"], "--top -1"),
    ("zero stage 5", BASE + L + ["--zero-stage", "5"], "argument --zero-stage: invalid choice: 5"),
    ("margin 1", BASE + ["--search", "--memory-margin", "1"], "--memory-margin 1.0: must be a fraction"),
    ("negative margin", BASE + L + ["--memory-margin", "-0.1"], "--memory-margin -0.1"),
    ("nan margin", BASE + ["--search", "--memory-margin", "nan"], "--memory-margin nan"),
    ("text margin", BASE + ["--search", "--memory-margin", "ten"], "argument --memory-margin: 'ten' is not a number"),
    ("chart format", BASE + L + ["--chart", "plan.txt"], "--chart plan.txt: write a .png"),
]

LAYOUTS = [  # (id, --layout text, what stderr must name); llama3-8b: 32 layers, 32 heads, 8 kv heads
    ("dp 0", "dp=0,tp=16", "dp=0 must be a whole number >= 1"),
    ("negative tp", "dp=-2,tp=-8", "dp=-2 must be"),
    ("m 0", "dp=16,m=0", "microbatches=0 must be"),
    ("v 0", "dp=4,pp=4,m=4,v=0", "virtual=0 must be"),
    ("zero 4", "dp=16,zero=4", "zero_stage=4: use 0, 1, 2 or 3"),
    ("rep not dividing dp", "dp=16,rep=3,zero=3", "rep=3 does not divide dp=16"),
    ("ep 0", "dp=16,ep=0", "ep=0 must be >= 1"),
    ("text degree", "dp=two", "dp must be an integer, got 'two'"),
    ("unknown key", "dp=16,dq=2", "cannot read 'dq=2'"),
    ("duplicate key", "dp=2,dp=16", "'dp=2' and 'dp=16' both set dp"),
    ("duplicate alias", "dp=4,pp=4,m=4,microbatches=8", "both set microbatches"),
    ("duplicate schedule", "dp=4,pp=4,m=4,1f1b,schedule=afab", "both set schedule"),
    ("bad flag", "dp=16,sp=maybe", "sp takes 1 or 0"),
    ("bad uneven", "dp=4,pp=4,m=4,uneven=2", "uneven takes 1 or 0"),
    ("bad ac", "dp=16,ac=most", "ac='most': choose one of"),
    ("bad precision", "dp=16,precision=fp16", "precision='fp16': choose one of"),
    ("bad order", "dp=16,order=nccl", "order='nccl'"),
    ("bad offload", "dp=16,offload=disk,zero=3", "offload = 'disk' is not one of"),
    ("tp not splitting heads", "dp=1,tp=16", "tp=16 does not split 32 heads"),
    ("uneven pipeline", "dp=4,pp=4,m=4,v=3,interleaved", "pp*v = 12 stages do not split 32 layers evenly"),
    ("1f1b m < pp", "dp=4,pp=4,m=2", "1f1b needs m >= pp: m=2, pp=4"),
    ("v without interleaved", "dp=4,pp=4,m=4,v=2", "v=2 needs the interleaved schedule"),
    ("ep on a dense model", "dp=16,ep=2", "needs a mixture-of-experts model"),
    ("fills 8 of 16", "dp=8", "uses 8 GPUs, not --gpus 16"),
]
SP = ("sp: seq not divisible by tp", _with("--seq", "4098") + ["--layout", "dp=4,tp=4"],
      "--seq 4098 is not divisible by cp x tp = 4")
CP = ("layout cp not 2 x dividing seq", _with("--seq", "4112") + ["--layout", "dp=1,cp=16"],
      "cp=16 needs --seq divisible by 2 x cp = 32")  # 4112 = 257 x 16: cp=16 divides it, 32 does not
INTERLEAVED = ("layout interleaved m not a multiple of pp",
               _with("--global-batch", "24") + ["--layout", "dp=2,pp=8,m=12,v=2,interleaved"],
               "interleaved needs m a multiple of pp=8")
TIED = ("tied embedding on a pipeline", ["plan", "--model", "1b", "--cluster", "h100", "--gpus", "8", "--global-batch",
                                         "8", "--seq", "2048", "--layout", "dp=4,pp=2,m=2"], "ties its embedding")

# Every Cluster field, each with a value of the wrong type and, where it has one, one out of range:
# (field, TOML value, what stderr must name). test_every_cluster_field_is_covered keeps it complete.
TOML_FIELDS = [
    ("name", "5", "name = 5 must be a string"),
    ("gpus_per_node", '"x"', "gpus_per_node = 'x' must be a whole number"),
    ("gpus_per_node", "8.5", "gpus_per_node = 8.5 must be a whole number"),
    ("gpus_per_node", "0", "gpus_per_node = 0 must be >= 1"),
    ("memory_bytes", "-1", "memory_bytes = -1 must be > 0"),
    ("memory_bytes", "nan", "memory_bytes = nan must be finite"),
    ("memory_bytes", "true", "memory_bytes = True must be a number"),
    ("peak_flops", "0", "peak_flops = 0 must be > 0"),
    ("peak_flops", '"989e12"', "peak_flops = '989e12' must be a number"),
    ("fp32_flops", "-67e12", "fp32_flops = -67000000000000.0 must be > 0"),
    ("hbm_bandwidth", "inf", "hbm_bandwidth = inf must be finite"),
    ("matmul_efficiency", "1.5", "matmul_efficiency = 1.5 must be <= 1"),
    ("attention_efficiency", "0", "attention_efficiency = 0 must be > 0"),
    ("attention_bwd_efficiency", "1.2", "attention_bwd_efficiency = 1.2 must be <= 1"),
    ("fused_attention_speedup", "0.9", "fused_attention_speedup = 0.9 must be >= 1"),
    ("fa1_attention_efficiency", "1.5", "fa1_attention_efficiency = 1.5 must be <= 1"),
    ("hbm_efficiency", "-0.7", "hbm_efficiency = -0.7 must be > 0"),
    ("fp8_speedup", "0.5", "fp8_speedup = 0.5 must be >= 1"),
    ("gemm_k0", "-720", "gemm_k0 = -720 must be >= 0"),
    ("sm_count", "-1", "sm_count = -1 must be >= 0"),
    ("sm_count", "132.5", "sm_count = 132.5 must be a whole number"),
    ("eager_elementwise_passes", "0.5", "eager_elementwise_passes = 0.5 must be >= 1"),
    ("reserved_bytes", "-1", "reserved_bytes = -1 must be >= 0"),
    ("reserved_bytes", "1e15", "reserved_bytes = 1e+15 leaves nothing of memory_bytes"),
    ("backend", '"mpi"', "backend = 'mpi' must be one of nccl, host"),
    ("memory_shared", '"yes"', "memory_shared = 'yes' must be true or false"),
    ("cores", "-1", "cores = -1 must be >= 0"),
    ("cores", "2.5", "cores = 2.5 must be a whole number"),
    ("reduce_gamma", "-1e-10", "reduce_gamma = -1e-10 must be >= 0"),
    ("profile_compute", "true", "profile_compute = true times blocks on this machine"),
    ("profile_compute", "1", "profile_compute = 1 must be true or false"),
    ("base_memory_bytes", "-3e8", "base_memory_bytes = -300000000.0 must be >= 0"),
    ("pcie_bandwidth", "-50e9", "pcie_bandwidth = -50000000000.0 must be >= 0"),
    ("host_adam_rate", '"fast"', "host_adam_rate = 'fast' must be a number"),
    ("host_memory_bytes", "-2e12", "host_memory_bytes = -2000000000000.0 must be >= 0"),
    ("notes", "[1]", "notes = [1] must be a string"),
]
TOML_TABLES = [  # (id, TOML text, what stderr must name)
    ("intra not a table", 'base = "h100"\nintra = 5\n', "[intra]: must be a table"),
    ("inter bandwidth 0", 'base = "h100"\n[inter]\nlatency = 2e-5\nbandwidth = 0\n',
     "[inter] bandwidth = 0 must be > 0"),
    ("inter latency negative", 'base = "h100"\n[inter]\nlatency = -1\nbandwidth = 45e9\n', "latency = -1 must be >= 0"),
    ("inter latency text", 'base = "h100"\n[inter]\nlatency = "fast"\nbandwidth = 45e9\n', "must be a number"),
    ("intra unknown key", 'base = "h100"\n[intra]\nlatency = 1e-5\nbandwidth = 3e11\nbw = 1\n', "unknown keys ['bw']"),
    ("intra missing key", 'base = "h100"\n[intra]\nlatency = 1e-5\n', "missing ['bandwidth']"),
    ("unknown base", 'base = "h1000"\n', "base = 'h1000' is not a preset"),
    ("base not text", "base = 5\n", "base = 5 is not a preset"),
    ("unknown field", 'base = "h100"\ngpus = 8\n', "unknown keys ['gpus']"),
    ("missing fields", "peak_flops = 1e12\n", "missing ["),
    ("not TOML", 'base = "h100\n', "cannot read TOML"),
]


def _cases():
    for name, argv, needle in FLAGS + [SP, CP, INTERLEAVED, TIED]:
        yield pytest.param(argv, None, needle, id=name)
    for name, text, needle in LAYOUTS:
        yield pytest.param(BASE + ["--layout", text], None, needle, id=f"layout {name}")
    for field, value, needle in TOML_FIELDS:
        yield pytest.param(None, f'base = "h100"\n{field} = {value}\n', needle, id=f"toml {field} = {value}")
    for name, text, needle in TOML_TABLES:
        yield pytest.param(None, text, needle, id=f"toml {name}")


def _exit_code(argv: list[str]) -> int:
    """``meshtrain``'s exit status in-process: argparse's own errors raise SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


@pytest.mark.parametrize("argv, toml, needle", list(_cases()))
def test_bad_input_exits_2_naming_it_and_prints_no_result(argv, toml, needle, tmp_path, capsys):
    if toml is not None:
        path = tmp_path / "mine.toml"
        path.write_text(toml)
        argv = _with("--cluster", str(path)) + ["--layout", "dp=16"]
    chart = tmp_path / "plan.png"
    assert _exit_code(argv + ["--chart", str(chart)] if "--chart" not in argv else argv) == 2
    out, err = capsys.readouterr()
    assert needle in err, err
    assert out == "" and not chart.exists()  # no result, no partial file


def test_every_cluster_field_is_covered():
    covered = {field for field, _, _ in TOML_FIELDS} | {"intra", "inter"}
    assert covered == {f.name for f in dataclasses.fields(Cluster)}


def test_the_presets_pass_the_checks_a_toml_gets(tmp_path):
    for name in PRESETS:
        path = tmp_path / f"{name}.toml"
        path.write_text(f'base = "{name}"\n')  # every field of the preset, checked as a TOML's are
        assert dataclasses.replace(resolve_cluster(str(path)), name=name) == PRESETS[name]


def test_an_uneven_pipeline_split_is_priced_when_asked_for():
    a = ARCHS["llama3-405b"]  # 126 layers: torchtitan runs it on 8 stages, Megatron would not
    pred = predict(a, PRESETS["h100"], parse_layout("dp=8,tp=8,pp=8,m=8,uneven=1,zero=3,ac=full"), 64, 8192)
    assert pred.layout.label().count("uneven=1") == 1 and parse_layout(pred.layout.label()) == pred.layout


def test_a_partial_node_is_priced_when_asked_for_with_a_warning(capsys):
    argv = _with("--gpus", "12", _with("--global-batch", "24"))
    assert main(argv + ["--layout", "dp=12", "--allow-partial-node"]) == 0
    out, err = capsys.readouterr()
    assert "dp=12" in out and "last of 2 nodes with 4 of its 8 GPUs" in err


def test_search_keeps_the_memory_margin():
    a, c = ARCHS["llama3-8b"], PRESETS["h100"]
    loose = search(a, c, 8, 16, 8192, top=10_000, memory_margin=0.0)
    strict = search(a, c, 8, 16, 8192, top=10_000, memory_margin=0.10)
    assert all(p.memory.total <= 0.9 * p.capacity for p in strict)
    # some layouts fit only without the margin: the search must have dropped (or recomputed) them
    tight = {p.layout.label() for p in loose if p.memory.total > 0.9 * p.capacity}
    assert tight and not tight & {p.layout.label() for p in strict}


def test_search_prints_its_margin_in_the_header_and_json(capsys):
    assert main(BASE + ["--search", "--top", "2", "--memory-margin", "0.25"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    cap = resolve_cluster("h100").memory_per_rank(16) / 2**30
    assert head.startswith("# --search") and f"--memory-margin 0.25" in head and f"{0.75 * cap:.1f} GiB" in head
    assert main(BASE + ["--search", "--top", "2", "--memory-margin", "0.25", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_margin"] == 0.25
    assert all(row["memory_bytes"]["total"] <= 0.75 * row["capacity_bytes"] for row in data["layouts"])


def test_search_leaves_out_what_the_layout_rules_refuse():
    # 10m: 6 layers. pp=4 splits them unevenly (Megatron refuses; priced only with uneven), and
    # cp=8 needs --seq divisible by 16 (each cp rank takes two chunks): --seq 24 is not
    a, c = resolve_model("10m"), PRESETS["h100"]
    shapes = {(p.layout.pp, p.layout.cp) for p in search(a, c, 8, 8, 24, top=10_000, memory_margin=0.0)}
    assert not {pp for pp, _ in shapes} & {4} and not {cp for _, cp in shapes} & {8}
    uneven = search(a, c, 8, 8, 24, {"uneven": True}, top=10_000, memory_margin=0.0)
    assert 4 in {p.layout.pp for p in uneven}


def _four_gpu_nodes(tmp_path) -> str:
    path = tmp_path / "four.toml"
    path.write_text('base = "h100"\ngpus_per_node = 4\n')
    return str(path)


def test_tp_across_nodes_is_priced_with_a_warning(tmp_path, capsys):
    argv = _with("--cluster", _four_gpu_nodes(tmp_path))
    assert main(argv + ["--layout", "dp=2,tp=8", "--layout", "dp=4,tp=4"]) == 0
    out, err = capsys.readouterr()
    assert "dp=2,tp=8" in out and "tp=8 spans 2 nodes of 4 GPUs" in err and "tp=4 " not in err


def test_a_tp_that_straddles_nodes_is_flagged(tmp_path, capsys):
    path = tmp_path / "six.toml"
    path.write_text('base = "h100"\ngpus_per_node = 6\n')
    argv = ["plan", "--model", "llama3-8b", "--cluster", str(path), "--gpus", "12", "--global-batch", "12",
            "--seq", "4096", "--layout", "dp=3,tp=4"]
    assert main(argv) == 0
    assert "tp=4 does not divide the 6 GPUs of a node" in capsys.readouterr().err


def test_search_warns_for_a_ranked_layout_whose_tp_crosses_nodes(tmp_path, capsys, monkeypatch):
    # --search's own candidates keep tp inside a node; should that rule change, the warning shows
    wide = parse_layout("dp=2,tp=8")
    monkeypatch.setattr(search_module, "candidates", lambda *args: iter([wide]))
    assert main(_with("--cluster", _four_gpu_nodes(tmp_path)) + ["--search"]) == 0
    out, err = capsys.readouterr()
    assert "dp=2,tp=8" in out and "tp=8 spans 2 nodes" in err
