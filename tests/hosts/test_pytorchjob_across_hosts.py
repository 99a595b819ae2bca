"""``meshtrain launch --emit k8s --device cpu``'s PyTorchJob run as its pods would run it: the Master
and Worker containers' command, taken from the manifest, on two simulated hosts (meshtrain.simhosts),
each with exactly the environment the Kubeflow training operator gives that pod.

The environment is the operator's as of training-operator v1.9.0 (``setPodEnv`` in
pkg/controller.v1/pytorch/envvar.go and master.go; the SDK the schema test uses, kubeflow-training
1.9.4, is that release's), for a job without ``elasticPolicy`` or ``nprocPerNode``, after the
operator's defaulting (``nprocPerNode`` = "auto"): the container's own ``env``, then
PYTHONUNBUFFERED=1, MASTER_PORT and PET_MASTER_PORT (the Master's ``pytorchjob-port``),
MASTER_ADDR and PET_MASTER_ADDR (the Master's service, ``NAME-master-0``), WORLD_SIZE (replicas x
nproc, "auto" counting 1), RANK and PET_NODE_RANK (0 for the Master, i + 1 for Worker i),
PET_NPROC_PER_NODE ("auto") and PET_NNODES (replicas). torchrun reads ``PET_*`` as defaults, so
the manifest's own ``--nproc-per-node`` must override PET_NPROC_PER_NODE=auto: the run shows it does.

What the simulation changes, and nothing else: MASTER_ADDR / PET_MASTER_ADDR are 127.0.0.1 (the
service name does not resolve here); the ConfigMap is a file in the test's directory, not
``/etc/meshtrain`` (the one argument replaced); the image's environment is PATH (this venv first),
HOME and MESHTRAIN_CACHE_DIR (the reference run's token caches), GLOO_SOCKET_IFNAME=lo (the hosts
share the loopback interface) and the host's own TMPDIR.

The job exits 0 on both hosts, its losses equal the same layout with its ranks as threads
(``comm.transport = "local"``) bitwise (every cross-rank sum of dp2 x tp2 has 2 terms, as in
test_training_across_hosts.py), and the run directory is complete.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshtrain.cli import main
from meshtrain.simhosts import SimulatedHosts, free_port

from ._util import skip_without_namespaces, tiny_job_config

STEPS = 4
CONFIG = tiny_job_config(STEPS)


def operator_env(job: dict[str, Any], rtype: str, index: int) -> dict[str, str]:
    """The variables training-operator v1.9.0 adds to the container of pod ``rtype``-``index``
    (a job without elasticPolicy: its ``nprocPerNode`` defaults to "auto")."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    (port,) = [p["containerPort"] for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch"
               for p in c.get("ports", []) if p["name"] == "pytorchjob-port"]  # else the operator fails the pod
    replicas = sum(s.get("replicas", 1) for s in specs.values())
    nproc = job["spec"].get("nprocPerNode", "auto")
    rank = index + 1 if rtype == "Worker" else index
    master = f"{job['metadata']['name']}-master-0"
    return {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port), "MASTER_ADDR": master,
            "PET_MASTER_ADDR": master, "WORLD_SIZE": str(replicas * (int(nproc) if nproc.isdigit() else 1)),
            "RANK": str(rank), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(replicas)}


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command: ``$(VAR)`` is VAR's value where the
    container defines it (else left as is), ``$$`` is ``$``."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def pod(job: dict[str, Any], configmap: dict[str, Any], rtype: str, index: int,
        config_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of pod ``rtype``-``index``, simulated as the module says."""
    spec = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    env.update(operator_env(job, rtype, index), MASTER_ADDR="127.0.0.1", PET_MASTER_ADDR="127.0.0.1")
    argv = [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
    assert not [a for a in argv if "$(" in a], f"a variable the pod does not define: {argv}"
    # the ConfigMap's files, at its mount path in the pod; here in config_dir
    (volume,) = [v["name"] for v in spec["volumes"]
                 if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]]
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == volume]
    local = {f"{mount}/{key}": str(config_dir / key) for key in configmap["data"]}
    assert sum(a in local for a in argv) == 1, argv  # the command reads the config from the mount
    argv = [local.get(a, a) for a in argv]
    image = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
             "HOME": str(Path.home()), "MESHTRAIN_CACHE_DIR": os.environ["MESHTRAIN_CACHE_DIR"],
             "GLOO_SOCKET_IFNAME": "lo"}
    return argv, {**image, **env}


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(60)
def test_pytorchjob_pods_run_with_the_operators_environment(tmp_path):
    skip_without_namespaces()
    (tmp_path / "cpu.toml").write_text(CONFIG)
    # The reference first: it also builds the token caches the pods then read.
    assert main(["train", "--config", str(tmp_path / "cpu.toml"), f"--out={tmp_path / 'reference'}",
                 "--comm.transport=local", "--no-progress"]) == 0
    run, manifest = tmp_path / "run", tmp_path / "job.yaml"
    assert main(["launch", "--emit", "k8s", "--device", "cpu", "--nodes", "2", "--procs-per-node", "2",
                 "--cpus-per-proc", "1", "--config", str(tmp_path / "cpu.toml"), "--run-dir", str(run),
                 "--port", str(free_port()), "--out", str(manifest)]) == 0
    configmap, job = yaml.safe_load_all(manifest.read_text())
    config_dir = tmp_path / "configmap"
    config_dir.mkdir()
    for key, text in configmap["data"].items():
        (config_dir / key).write_text(text, newline="")  # byte for byte, as the volume holds it

    pods = [pod(job, configmap, "Master", 0, config_dir), pod(job, configmap, "Worker", 0, config_dir)]
    assert [env["RANK"] for _, env in pods] == ["0", "1"] and pods[0][0][0] == "torchrun"
    with SimulatedHosts.commands([argv for argv, _ in pods], [env for _, env in pods], tmp_path / "hosts",
                                 cwd=tmp_path) as hosts:
        codes = hosts.wait(50)
        assert codes == [0, 0], hosts.tails()
        assert [hosts.shm_left(k) for k in range(2)] == [[], []]
    assert _losses(run) == _losses(tmp_path / "reference")  # bitwise, every step
    assert len(_losses(run)) == STEPS
    assert {"metrics.jsonl", "summary.json", "config.toml", "loss.png", "checkpoints"} <= {
        p.name for p in run.iterdir()}
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest.endswith(f"{STEPS:08d}") and (run / "checkpoints" / latest / "metadata.json").is_file()
    assert "Traceback" not in hosts.log(0) + hosts.log(1)
