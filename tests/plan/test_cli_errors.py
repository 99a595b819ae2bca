"""``meshtrain plan`` end to end: bad input gives a named ConfigError with the nearest valid choice
and exit 2; good input gives a ranked table, JSON and a PNG; TOML and this-host clusters load."""

import json

import pytest

from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.plan.architectures import ARCHS, resolve_model
from meshtrain.plan.clusters import PRESETS, resolve_cluster
from meshtrain.plan.host import this_host
from meshtrain.plan.layout import Layout, parse_layout, validate
from meshtrain.plan.search import search
from meshtrain.plan.step import predict

BASE = ["plan", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "16", "--global-batch", "32",
        "--seq", "4096"]


def test_layout_that_does_not_fill_the_gpus_names_the_nearest_that_does():
    with pytest.raises(ConfigError, match=r"uses 8 GPUs, not --gpus 16.*dp=2,tp=8"):
        validate(parse_layout("dp=1,tp=8"), ARCHS["llama3-8b"], 16, 32, 4096)


def test_unknown_cluster_and_model_name_the_nearest():
    with pytest.raises(ConfigError, match="nearest: 'h200'"):
        resolve_cluster("h2000")
    with pytest.raises(ConfigError, match="nearest: 'llama3-70b'"):
        resolve_model("llama3-70")


def test_a_model_that_fits_nowhere_says_so():
    with pytest.raises(ConfigError, match="fits no layout of 8 GPUs"):
        search(ARCHS["llama3-405b"], PRESETS["a100"], 8, 8, 8192)


def test_batch_and_pipeline_constraints_name_the_fix():
    a = ARCHS["llama3-8b"]
    with pytest.raises(ConfigError, match="nearest: --global-batch"):
        validate(Layout(dp=16), a, 16, 20, 4096)
    with pytest.raises(ConfigError, match="use m=4"):
        validate(Layout(dp=4, pp=4, microbatches=2), a, 16, 32, 4096)
    with pytest.raises(ConfigError, match="valid tp"):
        validate(Layout(dp=1, tp=16), a, 16, 32, 4096)


@pytest.mark.parametrize("argv,needle", [
    (BASE[:4] + ["h1000"] + BASE[5:] + ["--layout", "dp=16"], "nearest: 'h100'"),
    (BASE + ["--layout", "dp=8"], "not --gpus 16"),
    (["plan", "--model", "llama3-405b", "--cluster", "a100", "--gpus", "8", "--global-batch", "8", "--seq", "8192",
      "--search"], "fits no layout"),
    (BASE + ["--layout", "dp=16,zero=1,opg=maybe"], "opg takes 1 or 0"),
])
def test_cli_exits_2_with_the_error(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_cli_table_json_and_chart(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(BASE + ["--layout", "dp=16,zero=3", "--layout", "dp=2,tp=8", "--chart", str(png)]) == 0
    out = capsys.readouterr().out
    assert "dp=16" in out and "dp=2,tp=8" in out and "MFU" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(BASE + ["--search", "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    times = [row["step_time_s"] for row in data["layouts"]]
    assert times == sorted(times) and len(times) == 3 and all(row["fits"] for row in data["layouts"])


def test_search_ranks_first_a_layout_no_slower_than_a_hand_picked_one():
    a, c = ARCHS["llama3-8b"], PRESETS["h100"]
    best = search(a, c, 16, 32, 4096, top=1)[0]
    for text in ("dp=16,zero=3,ac=full", "dp=2,tp=8,ac=none", "dp=4,pp=4,m=8,zero=1,ac=full"):
        assert best.step_time <= predict(a, c, parse_layout(text), 32, 4096).step_time


def test_toml_cluster_with_a_base_preset(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('base = "h100"\ngpus_per_node = 4\n[inter]\nlatency = 5e-5\nbandwidth = 12.5e9\n')
    c = resolve_cluster(str(f))
    assert (c.name, c.gpus_per_node, c.inter.bandwidth, c.peak_flops) == ("mine", 4, 12.5e9, 989e12)
    bad = tmp_path / "bad.toml"
    bad.write_text("peak_flops = 1e12\n")
    with pytest.raises(ConfigError, match="missing"):
        resolve_cluster(str(bad))


def test_this_host_uses_the_calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    (tmp_path / "calibration.json").write_text(json.dumps(
        {"shm::4:1": {"alpha": 2e-5, "beta": 1 / 2e9, "gamma": 1 / 3e9, "source": "measured"}}))
    c = this_host(peak=1e11)
    assert c.intra.latency == 2e-5 and c.intra.bandwidth == pytest.approx(2e9) and c.backend == "host"
    # ranks share the host: each of 4 ranks on a host with fewer cores gets 1/4 of the peak
    assert c.per_rank_peak(max(4, c.cores), "bf16") == pytest.approx(1e11 / max(4, c.cores))


def test_search_proposes_only_checkpointing_meshtrain_train_offers():
    preds = search(ARCHS["llama3-8b"], PRESETS["h100"], 8, 16, 8192, top=50)
    assert preds and {p.layout.ac for p in preds} <= {"none", "selective", "full"}


def test_json_model_config(tmp_path):
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps({"dim": 512, "n_layers": 6, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1376,
                             "vocab_size": 1000}))
    a = resolve_model(str(f))
    assert (a.name, a.dim, a.n_layers, a.kv_dim) == ("tiny", 512, 6, 4 * 64)
    f.write_text(json.dumps({"dim": 512, "layers": 6}))
    with pytest.raises(ConfigError, match="unknown keys \\['layers'\\]"):
        resolve_model(str(f))
