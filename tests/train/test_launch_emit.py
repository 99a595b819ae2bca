"""``meshtrain launch``: the sbatch script and the PyTorchJob manifest, parsed and checked field by
field; their torchrun commands go through torchrun's own argument parser and the workers' config
loader; bad input exits 2 with a message and writes no file."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from meshtrain.train import launch_emit
from meshtrain.train.config import load_config

CONFIG = """# a cluster run: 8 ranks
[model]
preset = "test"   # "quoted" comment

[parallel]
dp = 4
tp = 2

[train]
steps = 10
warmup_steps = 2
\t# a tab-led line
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "my_run.toml"
    path.write_text(CONFIG)
    return path


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="meshtrain launch")
    launch_emit.add_arguments(parser)
    return launch_emit.main(parser.parse_args(list(argv)))


def emit(tmp_path: Path, config: Path, kind: str, nodes: int, gpus: int | None, *extra: str) -> str:
    """Emit to a file and return it; ``gpus`` None: no --gpus-per-node (the cpu form)."""
    out = tmp_path / f"job.{kind}"
    per_node = ["--gpus-per-node", str(gpus)] if gpus is not None else []
    assert run("--emit", kind, "--nodes", str(nodes), *per_node, "--config", str(config), "--out", str(out),
               *extra) == 0
    return out.read_text()


def torchrun_args(argv: list[str]) -> argparse.Namespace:
    from torch.distributed.run import get_args_parser

    assert argv[0] == "torchrun"
    return get_args_parser().parse_args(argv[1:])


def worker_config(script_args: list[str], config_path: Path):
    """What ``python -m meshtrain.train`` would load from these arguments."""
    args = list(script_args)
    i = args.index("--config")
    del args[i : i + 2]
    return load_config(str(config_path), args)


# ------------------------------------------------------------------------------------------- k8s

def test_k8s_manifest_fields(tmp_path, config):
    text = emit(tmp_path, config, "k8s", 2, 4, "--image", "reg.io/mesh:1.0", "--port", "23456")
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    cm, job = docs
    assert cm["apiVersion"] == "v1" and cm["data"]["config.toml"] == CONFIG  # byte for byte
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "meshtrain-my-run"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "reg.io/mesh:1.0"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert {"name": "pytorchjob-port", "containerPort": 23456} in c["ports"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["NCCL_DEBUG"] == "WARN" and env["OMP_NUM_THREADS"] == "8"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
        assert volumes[mounts["/etc/meshtrain"]]["configMap"]["name"] == cm["metadata"]["name"]
        cmd = c["command"]
        assert cmd[0] == "torchrun" and cmd[cmd.index("-m") + 1] == "meshtrain.train"
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "4"
        assert cmd[cmd.index("--config") + 1] == "/etc/meshtrain/config.toml"
        assert cmd[-2:] == ["--comm.backend=nccl", "--train.device=cuda"]
    assert "runPolicy" not in job["spec"]


def test_k8s_command_parses_as_torchrun_and_worker(tmp_path, config):
    """Expand $(VAR) as Kubernetes does with the operator's env, then parse like torchrun and the worker."""
    cm, job = yaml.safe_load_all(emit(tmp_path, config, "k8s", 2, 4))
    env = {"RANK": "1", "MASTER_ADDR": "meshtrain-my-run-master-0", "MASTER_PORT": "29500"}
    cmd = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    a = torchrun_args([re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], x) for x in cmd])
    assert (a.nnodes, a.nproc_per_node, a.node_rank) == ("2", "4", 1)
    assert (a.master_addr, a.master_port, a.module, a.training_script) == (
        "meshtrain-my-run-master-0", 29500, True, "meshtrain.train")
    mounted = tmp_path / "config.toml"
    mounted.write_text(cm["data"]["config.toml"])
    cfg = worker_config(a.training_script_args, mounted)
    assert (cfg.out, cfg.comm.backend, cfg.train.device) == ("/runs/meshtrain-my-run", "nccl", "cuda")
    assert cfg.parallel.world_size == 8


@pytest.mark.parametrize("nodes, gpus", [(1, 8), (4, 2)])
def test_k8s_replicas(tmp_path, config, nodes, gpus):
    _, job = yaml.safe_load_all(emit(tmp_path, config, "k8s", nodes, gpus))
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {"replicas": 0})["replicas"] == nodes - 1
    c = specs["Master"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert c["command"][c["command"].index("--nnodes") + 1] == str(nodes)


def test_k8s_options(tmp_path, config):
    _, job = yaml.safe_load_all(emit(tmp_path, config, "k8s", 2, 4, "--name", "exp-1", "--time", "1-02:00:30",
                                     "--pvc", "shared-runs", "--run-dir", "/runs/exp-1/a"))
    assert job["metadata"]["name"] == "exp-1"
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 26 * 3600 + 30
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "shared-runs"}} in pod["volumes"]
    assert {"name": "runs", "mountPath": "/runs"} in pod["containers"][0]["volumeMounts"]
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--out") + 1] == "/runs/exp-1/a"


@pytest.mark.parametrize("text", [
    "plain\n", "a\n  indented\n\ttab\n", " leading space\nx\n", "ws-only\n   \nx\n", "two\n\n", "no newline\nend",
    'q"u\\o\'te: #x\n', "é ü\n\x01ctl\n", "crlf\r\nx\r\n", "yes", "1:20", "", "-1", "--flag", "$(VAR)", "a: b",
    "null", "~", "@x", "*a", "&b", "!t", "%p"])
def test_yaml_strings_read_back(text):
    lines = launch_emit.to_yaml({"a": {"text": text, "list": [text, {"k": text}]}, "z": 1})
    doc = yaml.safe_load("\n".join(lines) + "\n")
    assert doc == {"a": {"text": text, "list": [text, {"k": text}]}, "z": 1}


# ------------------------------------------------------------------------------------------- slurm

def sbatch_parts(script: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(#SBATCH options, other lines, the srun command as argv) of an sbatch script."""
    lines = script.replace("\\\n", " ").splitlines()
    opts = dict(line[len("#SBATCH --"):].split("=", 1) for line in lines if line.startswith("#SBATCH --"))
    (srun,) = [line for line in lines if line.startswith("srun ")]
    return opts, lines, shlex.split(srun)


def test_slurm_script_fields(tmp_path, config):
    script = emit(tmp_path, config, "slurm", 2, 4, "--partition", "gpu", "--time", "02:30:00", "--port", "29600")
    assert script.startswith("#!/bin/bash\n")
    opts, lines, argv = sbatch_parts(script)
    assert opts == {"job-name": "meshtrain-my_run", "nodes": "2", "ntasks-per-node": "1", "gpus-per-node": "4",
                    "cpus-per-task": "32", "partition": "gpu", "time": "02:30:00", "output": "%x-%j.out"}
    assert any("scontrol show hostnames" in x and "$SLURM_JOB_NODELIST" in x and "head -n1" in x
               and x.startswith("export MASTER_ADDR=") for x in lines)
    assert "export MASTER_PORT=29600" in lines
    assert argv[:3] == ["srun", "--cpus-per-task=32", "torchrun"]  # 22.05's srun does not inherit it
    flags = dict(zip(argv[3:15:2], argv[4:15:2]))
    assert flags == {"--nnodes": "$SLURM_NNODES", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": "$MASTER_ADDR:$MASTER_PORT", "--rdzv-id": "$SLURM_JOB_ID",
                     "-m": "meshtrain.train"}
    assert "export NCCL_DEBUG=\"${NCCL_DEBUG:-WARN}\"" in lines
    assert argv[15:] == ["--config", str(config.resolve()), "--out", "runs/meshtrain-my_run",
                         "--comm.backend=nccl", "--train.device=cuda"]


def test_slurm_defaults(tmp_path, config):
    opts, _, argv = sbatch_parts(emit(tmp_path, config, "slurm", 1, 8, "--run-dir", "/shared/my runs/x"))
    assert "partition" not in opts and opts["time"] == "01:00:00" and opts["cpus-per-task"] == "64"
    assert argv[argv.index("--out") + 1] == "/shared/my runs/x"


def test_slurm_script_runs(tmp_path, config):
    """Run the script with stand-in scontrol / srun: the srun argv is a torchrun command line that
    torchrun's parser and the worker's config loader accept."""
    emit(tmp_path, config, "slurm", 2, 4)
    script = tmp_path / "job.slurm"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", 'echo node-a; echo node-b'), ("srun", 'printf "%s\\n" "$@" > "$ARGV_FILE"')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_NNODES="2", SLURM_JOB_ID="4242", ARGV_FILE=str(tmp_path / "argv"))
    subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, check=True, timeout=30)
    srun_argv = (tmp_path / "argv").read_text().splitlines()
    assert srun_argv[0] == "--cpus-per-task=32"
    a = torchrun_args(srun_argv[1:])
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) == (
        "2", "4", "c10d", "node-a:29500", "4242")
    assert a.module and a.training_script == "meshtrain.train"
    assert (tmp_path / "runs" / "meshtrain-my_run").is_dir()
    cfg = worker_config(a.training_script_args, config)
    assert (cfg.out, cfg.comm.backend, cfg.train.device) == ("runs/meshtrain-my_run", "nccl", "cuda")


# ------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("kind", ["slurm", "k8s"])
@pytest.mark.parametrize("argv, message", [
    (["--nodes", "2", "--gpus-per-node", "8"], "needs 8 ranks, but --nodes 2 x --gpus-per-node 8 gives 16 GPUs; "
                                               "set parallel.dp = 8 in the config or use --nodes 1"),
    (["--nodes", "0", "--gpus-per-node", "8"], "--nodes must be >= 1, got 0"),
    (["--nodes", "1", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
    (["--nodes", "1", "--gpus-per-node", "8", "--config", "missing.toml"], "config file 'missing.toml' does not exist"),
    (["--nodes", "1", "--gpus-per-node", "8", "--time", "2h"], "--time '2h' is not [D-]HH:MM:SS"),
    (["--nodes", "1", "--gpus-per-node", "8", "--port", "0"], "--port must be in 1..65535"),
    (["--nodes", "1", "--gpus-per-node", "8", "--name", "bad name!"], "--name 'bad name!'"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, config, capsys, kind, argv, message):
    out = tmp_path / "job.out"
    argv = ["--emit", kind, "--config", str(config), *argv, "--out", str(out)]
    assert run(*argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.startswith("meshtrain launch: error: ")
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_run.toml"]  # no file, no temp file


def test_error_keeps_an_existing_file(tmp_path, config, capsys):
    out = tmp_path / "job.yaml"
    out.write_text("old")
    assert run("--emit", "k8s", "--nodes", "3", "--gpus-per-node", "8", "--config", str(config), "--out",
               str(out)) == 2
    assert "use --gpus-per-node" not in capsys.readouterr().err  # 8 ranks over 3 nodes: no integer fix
    assert out.read_text() == "old"


@pytest.mark.parametrize("argv, message", [
    (["--emit", "pbs"], "invalid choice: 'pbs'"),
    (["--emit", "k8s", "--partition", "gpu"], "--partition applies to --emit slurm only"),
    (["--emit", "slurm", "--image", "x"], "--image applies to --emit k8s only"),
    (["--emit", "k8s", "--name", "Upper_Case"], "is not a Kubernetes name"),
    (["--emit", "k8s", "--name", "job\n"], "is not a Kubernetes name"),
    (["--emit", "slurm", "--name", "job\n"], "use letters, digits"),
    (["--emit", "slurm", "--time", "01:00:00\n"], "is not [D-]HH:MM:SS"),
    (["--emit", "k8s", "--pvc", "c", "--run-dir", "/data/x"], "is outside /runs"),
    (["--emit", "k8s", "--out", "/nonexistent-dir/job.yaml"], "does not exist; create it first"),
    (["--emit", "k8s", "--config", "BINARY"], "is not UTF-8 text"),
])
def test_bad_options(tmp_path, config, capsys, argv, message):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[parallel]\n")
    argv = ["--nodes", "2", "--gpus-per-node", "4", "--config", str(config),
            *(str(binary) if a == "BINARY" else a for a in argv)]
    try:
        rc = run(*argv)
    except SystemExit as exc:  # argparse's own check of --emit
        rc = exc.code
    assert rc == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.toml", "my_run.toml"]


def test_stdout_and_warnings(tmp_path, config, capsys):
    assert run("--emit", "k8s", "--nodes", "4", "--gpus-per-node", "2", "--config", str(config)) == 0
    captured = capsys.readouterr()
    assert [d["kind"] for d in yaml.safe_load_all(captured.out)] == ["ConfigMap", "PyTorchJob"]
    assert "pass --pvc CLAIM" in captured.err
    assert run("--emit", "slurm", "--nodes", "8", "--gpus-per-node", "1", "--config", str(config), "--out",
               str(tmp_path / "job.sh")) == 0
    captured = capsys.readouterr()
    assert "tensor-parallel groups will span hosts" in captured.err
    assert captured.out.startswith(f"# wrote {tmp_path / 'job.sh'}") and "sbatch" in captured.out


# --------------------------------------------------------------------------------------------- cpu

def test_slurm_cpu_script_asks_for_cores_and_runs_gloo(tmp_path, config):
    script = emit(tmp_path, config, "slurm", 4, None, "--device", "cpu", "--procs-per-node", "2", "--cpus-per-proc", "3")
    opts, lines, argv = sbatch_parts(script)
    assert opts == {"job-name": "meshtrain-my_run", "nodes": "4", "ntasks-per-node": "1", "cpus-per-task": "6",
                    "time": "01:00:00", "output": "%x-%j.out"}  # no gpus-per-node / gpus
    assert "gpu" not in "".join(line for line in lines if line.startswith("#SBATCH"))
    assert "export OMP_NUM_THREADS=3" in lines and not any("NCCL" in line for line in lines)
    assert any("4 nodes x 2 processes = 8 ranks (dp=4 x tp=2), on CPU (gloo)" in line for line in lines)
    assert argv[:3] == ["srun", "--cpus-per-task=6", "torchrun"]
    a = torchrun_args(argv[2:])
    assert (a.nnodes, a.nproc_per_node) == ("$SLURM_NNODES", "2")
    cfg = worker_config(a.training_script_args, config)
    assert (cfg.comm.backend, cfg.train.device, cfg.parallel.world_size) == ("gloo", "cpu", 8)


@pytest.mark.parametrize("device, form", [("cpu", "cpu"), ("cuda", "cuda"), ("auto", "cuda")])
def test_device_defaults_to_the_configs(tmp_path, device, form):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG.replace("[train]\n", f'[train]\ndevice = "{device}"\n'))
    per_node = ["--procs-per-node", "2"] if form == "cpu" else ["--gpus-per-node", "2"]
    out = tmp_path / "job.sh"
    assert run("--emit", "slurm", "--nodes", "4", *per_node, "--config", str(path), "--out", str(out)) == 0
    opts, _, argv = sbatch_parts(out.read_text())
    assert ("gpus-per-node" in opts) == (form == "cuda")
    assert argv[-1] == f"--train.device={form}"
    # --device wins over the config
    other = "cuda" if form == "cpu" else "cpu"
    flip = ["--gpus-per-node", "2"] if other == "cuda" else ["--procs-per-node", "2"]
    assert run("--emit", "slurm", "--nodes", "4", *flip, "--device", other, "--config", str(path), "--out",
               str(out)) == 0
    assert sbatch_parts(out.read_text())[2][-1] == f"--train.device={other}"


def test_k8s_cpu_manifest(tmp_path, config):
    cm, job = yaml.safe_load_all(emit(tmp_path, config, "k8s", 2, None, "--device", "cpu", "--procs-per-node", "4",
                                      "--cpus-per-proc", "2"))
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        (c,) = spec["template"]["spec"]["containers"]
        assert c["resources"] == {"requests": {"cpu": "8"}}  # cores, no nvidia.com/gpu
        assert {e["name"]: e["value"] for e in c["env"]} == {"OMP_NUM_THREADS": "2"}
        cmd = c["command"]
        assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
        assert cmd[-2:] == ["--comm.backend=gloo", "--train.device=cpu"]


@pytest.mark.parametrize("kind", ["slurm", "k8s"])
@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--nodes", "2"], "--device cpu needs --procs-per-node N"),
    (["--device", "cpu", "--nodes", "2", "--gpus-per-node", "4"], "--gpus-per-node 4 asks the scheduler for GPUs, "
                                                                  "which --device cpu does not use"),
    (["--device", "cuda", "--nodes", "2"], "--device cuda needs --gpus-per-node G"),
    (["--nodes", "2", "--gpus-per-node", "4", "--procs-per-node", "2"], "--procs-per-node 2 differs from "
                                                                        "--gpus-per-node 4; drop --procs-per-node"),
    (["--device", "cpu", "--nodes", "2", "--procs-per-node", "8"], "but --nodes 2 x --procs-per-node 8 gives 16 "
                                                                   "processes; set parallel.dp = 8"),
    (["--device", "cpu", "--nodes", "2", "--procs-per-node", "0"], "--procs-per-node must be >= 1, got 0"),
    (["--device", "cpu", "--nodes", "2", "--procs-per-node", "4", "--cpus-per-proc", "0"],
     "--cpus-per-proc must be >= 1, got 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--config", "TPU"], "train.device = 'tpu' is not one of cpu, cuda, "
                                                                  "auto; fix it, or pass --device cpu"),
])
def test_device_errors(tmp_path, config, capsys, kind, argv, message):
    tpu = tmp_path / "tpu.toml"
    tpu.write_text('[train]\ndevice = "tpu"\n')
    argv = ["--emit", kind, "--config", str(config), *(str(tpu) if a == "TPU" else a for a in argv),
            "--out", str(tmp_path / "job.out")]
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain launch: error: ") and message in err, err
    assert not (tmp_path / "job.out").exists()


# --------------------------------------------------------------------- the operator's PyTorchJob schema

SDK_VERSION = "1.9.4"  # kubeflow-training, pinned in pyproject.toml's dev extras


def _diff(want: Any, got: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want``: a key missing on either side, a value, or its type."""
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in sorted(want.keys() | got.keys()) for d in (
            _diff(want[k], got[k], f"{path}/{k}") if k in want and k in got
            else [f"{path}/{k}: {'dropped' if k in want else 'added'}"])]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in _diff(w, g, f"{path}[{i}]")]
    return [] if type(want) is type(got) and want == got else [f"{path}: {want!r} became {got!r}"]


def pytorchjob_schema_errors(manifest: dict) -> list[str]:
    """How ``manifest`` breaks the Kubeflow training operator's ``PyTorchJob`` schema; [] if it keeps it.

    The operator's Python SDK (``kubeflow-training``) has models generated from its OpenAPI spec
    (the pod template's, from the ``kubernetes`` client's). Deserializing into
    ``KubeflowOrgV1PyTorchJob`` checks required fields (client-side validation, on by default)
    and converts each value to its declared type; a key the schema does not know is dropped. So the
    manifest keeps the schema exactly when it serializes back unchanged: each difference names a
    field that is unknown or mistyped.
    """
    from kubeflow.training import ApiClient

    # The SDK's model requires spec.runPolicy (its Go field has no omitempty); the CRD that the API
    # server validates with requires only pytorchReplicaSpecs (v1.9's manifests/base/crds/
    # kubeflow.org_pytorchjobs.yaml), and the operator defaults the policy. So a manifest without
    # one is checked with an empty one, which adds no field to compare.
    spec = manifest.get("spec", {})
    if isinstance(spec, dict) and "runPolicy" not in spec:
        manifest = {**manifest, "spec": {**spec, "runPolicy": {}}}

    class Response:  # what ApiClient.deserialize reads: an HTTP response with a JSON body
        data = json.dumps(manifest)

    client = ApiClient()
    assert client.configuration.client_side_validation
    try:
        obj = client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    except (ValueError, TypeError) as exc:  # a required field missing, a value its type cannot take
        return [f"rejected: {exc}"]
    return _diff(manifest, client.sanitize_for_serialization(obj))


# ids without "cuda": tests/conftest.py skips a test with that keyword where torch sees no GPU
@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-manifest", "gpu-manifest"])
def test_k8s_manifest_keeps_the_operators_pytorchjob_schema(tmp_path, device):
    """Every field of the PyTorchJob (with the options that add fields: --time, --pvc) is one the
    Kubeflow training operator's schema declares, with its type: checked with the operator's SDK,
    kubeflow-training 1.9.4 (models generated from training-operator v1.9's OpenAPI spec)."""
    from importlib.metadata import version

    assert version("kubeflow-training") == SDK_VERSION  # the version docs/training.md names
    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "test"\n[parallel]\ndp = 2\ntp = 2\n')
    per_node = ["--procs-per-node", "2"] if device == "cpu" else ["--gpus-per-node", "2"]
    _, job = yaml.safe_load_all(emit(tmp_path, config, "k8s", 2, None, "--device", device, *per_node,
                                     "--time", "02:00:00", "--pvc", "shared"))
    assert job["spec"]["pytorchReplicaSpecs"].keys() == {"Master", "Worker"} and "runPolicy" in job["spec"]
    assert pytorchjob_schema_errors(job) == []


def _set(path: tuple, value: Any = None, rename: str | None = None) -> Callable[[dict], None]:
    """A mutation of a manifest: set the value at ``path``, or rename its last key to ``rename``."""
    def mutate(job: dict) -> None:
        parent = functools.reduce(lambda node, key: node[key], path[:-1], job)
        if rename is not None:
            parent[rename] = parent.pop(path[-1])
        else:
            parent[path[-1]] = value
    return mutate


_MASTER = ("spec", "pytorchReplicaSpecs", "Master")
_CONTAINER = (*_MASTER, "template", "spec", "containers", 0)


@pytest.mark.parametrize("mutate, error", [
    (_set(("spec", "pytorchReplicaSpecs"), rename="replicasSpecs"),
     "rejected: Invalid value for `pytorch_replica_specs`"),
    (_set((*_MASTER, "restartPolicy"), rename="restartPolcy"),
     "/spec/pytorchReplicaSpecs/Master/restartPolcy: dropped"),
    (_set((*_CONTAINER, "ports", 0, "containerPort"), "29500"), "containerPort: '29500' became 29500"),
    (_set((*_MASTER, "replicas"), "one"), "rejected: invalid literal for int()"),
    (_set((*_CONTAINER, "resources", "limits", "nvidia.com/gpu"), 2), "nvidia.com/gpu: 2 became '2'"),
    (_set((*_CONTAINER, "volumeMounts"), rename="volumeMount"), "containers[0]/volumeMount: dropped"),
], ids=["misspelled-required", "misspelled-optional", "string-for-int", "word-for-int", "int-for-quantity",
        "misspelled-in-the-pod"])
def test_pytorchjob_schema_check_catches_a_bad_field(tmp_path, config, mutate, error):
    """The check above fails on a manifest with one field misspelled or mistyped, naming it."""
    _, job = yaml.safe_load_all(emit(tmp_path, config, "k8s", 2, 4))
    assert pytorchjob_schema_errors(job) == []
    mutate(job)
    errors = pytorchjob_schema_errors(job)
    assert len(errors) == 1 and error in errors[0], errors
