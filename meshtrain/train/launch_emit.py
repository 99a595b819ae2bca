"""``meshtrain launch``: write the job that runs a config on a cluster: an sbatch script for Slurm,
or a Kubeflow ``PyTorchJob`` manifest (plus a ConfigMap holding the config) for Kubernetes. Either
way, each node runs one torchrun that starts ``python -m meshtrain.train`` once per GPU (``--device
cuda``: NCCL) or ``--procs-per-node`` times (``--device cpu``: gloo, and the job asks for cores, not GPUs).

The config is loaded and validated here first, with the device's overrides, and its layout must
fill nodes x processes-per-node exactly. A job that could not start is never written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from ..config.dims import DEGREES
from ..errors import ConfigError, MeshtrainError
from ..files import write_atomic
from . import elastic_launch

EMITTERS = ("slurm", "k8s")
DEVICES = ("cpu", "cuda", "auto")
# appended to every worker's command, per device
OVERRIDES = {"cuda": ("--comm.backend=nccl", "--train.device=cuda"), "cpu": ("--comm.backend=gloo", "--train.device=cpu")}
GPU_OVERRIDES = OVERRIDES["cuda"]
CONFIG_DIR = "/etc/meshtrain"  # where the ConfigMap is mounted in the pods
RUNS_DIR = "/runs"  # where --pvc mounts its claim in the pods
DEFAULT_TIME = "01:00:00"
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_TIME = re.compile(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)")
_K8S_NAME_MAX = 45  # pod names "<name>-worker-<i>" must stay within a 63-character DNS label


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain launch``."""
    p.add_argument("--emit", required=True, choices=EMITTERS,
                   help="slurm: an sbatch script; k8s: a Kubeflow PyTorchJob manifest with a ConfigMap")
    p.add_argument("--nodes", required=True, help="hosts (one torchrun per host): N, or MIN:MAX for an elastic job "
                   "that goes on while MIN of its MAX hosts are left (the layout fills MAX; see docs/training.md, "
                   "Elastic)")
    p.add_argument("--device", choices=DEVICES, help="cuda: one NCCL worker per GPU; cpu: gloo workers on cores "
                   "(--procs-per-node of them); auto: cuda (default: the config's train.device)")
    p.add_argument("--gpus-per-node", type=int, help="cuda: GPUs, and so worker processes, per host")
    p.add_argument("--procs-per-node", type=int, help="worker processes per host (needed on cpu; on cuda it is "
                   "--gpus-per-node)")
    p.add_argument("--config", required=True, help="the run's TOML config; its dp*pp*cp*tp must be nodes times "
                   "processes per node")
    p.add_argument("--out", help="write the script / manifest here (default: standard output)")
    p.add_argument("--name", help="job name (default: meshtrain-<config file stem>)")
    p.add_argument("--image", help="k8s: container image with meshtrain installed (default meshtrain:latest)")
    p.add_argument("--run-dir", help="the run directory every node writes to, on shared storage "
                   f"(default: slurm runs/NAME, relative to the submit directory; k8s {RUNS_DIR}/NAME)")
    p.add_argument("--partition", help="slurm: the partition")
    p.add_argument("--time", help=f"wall-clock limit [D-]HH:MM:SS (slurm default {DEFAULT_TIME}; k8s: "
                   "runPolicy.activeDeadlineSeconds, none by default)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node (default 29500)")
    p.add_argument("--cpus-per-proc", "--cpus-per-gpu", dest="cpus_per_proc", type=int, default=8,
                   help="CPU cores per worker process (default 8); sets OMP_NUM_THREADS, on slurm cpus-per-task "
                   "(this x processes per node) and on k8s a CPU request")
    p.add_argument("--pvc", help=f"k8s: a PersistentVolumeClaim mounted at {RUNS_DIR} in every pod (the shared "
                   "run directory)")
    p.add_argument("--max-restarts", type=int, help="elastic (--nodes MIN:MAX): torchrun's --max-restarts "
                   f"(default {elastic_launch.DEFAULT_MAX_RESTARTS}; each failure uses one)")
    p.add_argument("--rdzv-conf", help="elastic: c10d rendezvous settings KEY=VALUE,... over the defaults "
                   f"({elastic_launch.rdzv_conf_text(elastic_launch.RDZV_CONF)})")


@dataclasses.dataclass
class Job:
    """Everything an emitter needs, validated."""

    emit: str  # "slurm" or "k8s"
    name: str
    nodes: int
    procs: int  # worker processes per node (on cuda: its GPUs)
    cpus_per_proc: int
    config_path: str  # absolute
    config_text: str  # the file, byte for byte (the ConfigMap's content)
    layout: str  # "dp=4 x tp=2", for the header comment
    run_dir: str
    port: int
    image: str
    partition: str | None
    time: str | None
    pvc: str | None
    device: str = "cuda"  # "cuda" or "cpu"
    warnings: list[str] = dataclasses.field(default_factory=list)
    min_nodes: int | None = None  # elastic (--nodes MIN:MAX): MIN; ``nodes`` is MAX
    max_restarts: int = 0
    rdzv_conf: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def elastic(self) -> bool:
        """Whether the job goes on with fewer nodes than ``nodes`` (``--nodes MIN:MAX``, MIN < MAX)."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def overrides(self) -> tuple[str, ...]:
        """The flags every worker's command ends with."""
        return OVERRIDES[self.device] + (("--elastic.enabled=true",) if self.elastic else ())

    def describe(self) -> str:
        """"2 nodes x 4 GPUs = 8 ranks (dp=4 x tp=2)", or "... x 4 processes ... on CPU (gloo)"."""
        unit = "GPUs" if self.device == "cuda" else "processes"
        tail = "" if self.device == "cuda" else ", on CPU (gloo)"
        nodes = f"{self.min_nodes}-{self.nodes}" if self.elastic else str(self.nodes)
        elastic = f"; elastic: goes on with {self.min_nodes} to {self.nodes} nodes" if self.elastic else ""
        return f"{nodes} nodes x {self.procs} {unit} = {self.nodes * self.procs} ranks ({self.layout}){tail}{elastic}"


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def layout_name(p: Any, skip_ones: bool = False) -> str:
    """"dp=2 x pp=1 x ... x ep=1": every degree of the dimensions' table (``skip_ones``: those > 1)."""
    named = [f"{d.name}={getattr(p, d.name)}" for d in DEGREES if not skip_ones or getattr(p, d.name) > 1]
    return " x ".join(named) or "dp=1"


def _world_error(path: str, p: Any, nodes: int, procs: int, device: str = "cuda") -> ConfigError:
    per_node, unit = ("--gpus-per-node", "GPUs") if device == "cuda" else ("--procs-per-node", "processes")
    world, have = p.world_size, nodes * procs
    rest = world // p.dp  # the ranks of one data-parallel replica (every world degree but dp)
    fixes = [f"set parallel.dp = {have // rest} in the config"] if have % rest == 0 else []
    if world % procs == 0:
        fixes.append(f"use --nodes {world // procs}")
    elif world % nodes == 0:
        fixes.append(f"use {per_node} {world // nodes}")
    fixes = fixes or [f"choose --nodes and {per_node} whose product is {world}"]
    return ConfigError(f"{path}: the layout {layout_name(p)} needs {world} ranks, "
                       f"but --nodes {nodes} x {per_node} {procs} gives {have} {unit}; {' or '.join(fixes)}")


def seconds(time: str) -> int:
    """``[D-]HH:MM:SS`` as seconds; ``ConfigError`` if malformed."""
    m = _TIME.fullmatch(time)
    _need(m is not None, f"--time {time!r} is not [D-]HH:MM:SS; e.g. --time 02:30:00 or --time 1-00:00:00")
    d, h, mi, s = (int(x or 0) for x in m.groups())  # type: ignore[union-attr]
    return ((d * 24 + h) * 60 + mi) * 60 + s


def _procs_per_node(args: argparse.Namespace, device: str) -> int:
    """Worker processes per node: the GPUs on cuda, ``--procs-per-node`` on cpu."""
    gpus, procs = args.gpus_per_node, args.procs_per_node
    if device == "cpu":
        _need(gpus is None, f"--gpus-per-node {gpus} asks the scheduler for GPUs, which --device cpu does not use; "
              f"give the worker processes per node as --procs-per-node {gpus} (or use --device cuda)")
        _need(procs is not None, "--device cpu needs --procs-per-node N: the worker processes (gloo ranks) per "
              "node, e.g. the layout's dp*pp*cp*tp divided by --nodes")
        return procs
    _need(gpus is not None or procs is not None, "--device cuda needs --gpus-per-node G: the GPUs, and so worker "
          "processes, per node (on a CPU cluster use --device cpu --procs-per-node N)")
    _need(gpus is None or procs is None or gpus == procs, f"--device cuda runs one worker process per GPU, but "
          f"--procs-per-node {procs} differs from --gpus-per-node {gpus}; drop --procs-per-node")
    return gpus if gpus is not None else procs


def _device(args: argparse.Namespace) -> str:
    """``--device``, else the config's ``train.device``; ``auto`` is cuda (a cluster job is for GPUs
    unless told otherwise)."""
    from .config import load_config

    device = args.device or load_config(args.config, check=False).train.device
    _need(device in DEVICES, f"{args.config}: train.device = {device!r} is not one of {', '.join(DEVICES)}; fix "
          f"it, or pass --device cpu or --device cuda")
    return "cuda" if device == "auto" else device


def build_job(args: argparse.Namespace) -> Job:
    """Check the arguments and the config; the ``Job`` to emit. Raises ``ConfigError``."""
    from .config import load_config

    _need(args.emit in EMITTERS, f"--emit {args.emit!r} is not one of {', '.join(EMITTERS)}")
    k8s = args.emit == "k8s"
    min_nodes, nodes = elastic_launch.parse_nodes(args.nodes)
    elastic = min_nodes < nodes
    max_restarts, rdzv_conf = getattr(args, "max_restarts", None), getattr(args, "rdzv_conf", None)
    _need(elastic or (max_restarts is None and rdzv_conf is None), "--max-restarts and --rdzv-conf apply to an "
          f"elastic job (--nodes MIN:MAX) only; drop them, or give --nodes MIN:{nodes}")
    _need(max_restarts is None or max_restarts >= 0, f"--max-restarts must be >= 0, got {max_restarts}")
    conf = elastic_launch.parse_rdzv_conf(rdzv_conf) if elastic else {}
    for flag, value in (("--gpus-per-node", args.gpus_per_node),
                        ("--procs-per-node", args.procs_per_node), ("--cpus-per-proc", args.cpus_per_proc)):
        _need(value is None or value >= 1, f"{flag} must be >= 1, got {value}")
    _need(1 <= args.port <= 65535, f"--port must be in 1..65535, got {args.port}")
    if args.time is not None:
        seconds(args.time)
    for flag, value, only in (("--partition", args.partition, "slurm"), ("--image", args.image, "k8s"),
                              ("--pvc", args.pvc, "k8s")):
        _need(value is None or args.emit == only, f"{flag} applies to --emit {only} only; drop it")
    try:
        device = _device(args)
        procs = _procs_per_node(args, device)
        # The workers run with the device's overrides, so the config is checked with them.
        config = load_config(args.config, OVERRIDES[device])
    except UnicodeDecodeError:
        raise ConfigError(f"config file {args.config!r} is not UTF-8 text; pass a TOML file") from None
    p = config.parallel
    if p.world_size != nodes * procs:
        raise _world_error(args.config, p, nodes, procs, device)
    if elastic:  # every node count it may go on with has a layout
        elastic_launch.check_node_counts(config, min_nodes, nodes, procs, args.config)
    name = args.name or _default_name(args.config, k8s)
    if k8s:
        _need(bool(_DNS_LABEL.fullmatch(name)) and len(name) <= _K8S_NAME_MAX,
              f"--name {name!r} is not a Kubernetes name: use at most {_K8S_NAME_MAX} lowercase letters, digits "
              f"and '-', starting and ending with a letter or digit")
    else:
        _need(bool(_SLURM_NAME.fullmatch(name)), f"--name {name!r}: use letters, digits, '.', '_' and '-' only")
    text = Path(args.config).read_bytes().decode("utf-8")  # exact, CRLF included
    _need(not k8s or len(text.encode()) < 1 << 20, "the config is over 1 MiB, more than a ConfigMap holds; "
          "shorten it")
    run_dir = args.run_dir or (f"{RUNS_DIR}/{name}" if k8s else f"runs/{name}")
    if args.pvc:
        _need(run_dir.startswith(RUNS_DIR + "/"), f"--run-dir {run_dir!r} is outside {RUNS_DIR}, where --pvc "
              f"mounts its claim; use --run-dir {RUNS_DIR}/{name}")
    layout = layout_name(p, skip_ones=True)
    job = Job(args.emit, name, nodes, procs, args.cpus_per_proc,
              str(Path(args.config).resolve()), text, layout, run_dir, args.port, args.image or "meshtrain:latest",
              args.partition, args.time, args.pvc, device, min_nodes=min_nodes if elastic else None,
              max_restarts=elastic_launch.DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts,
              rdzv_conf=conf)
    if elastic and not (config.checkpoint.enabled and config.checkpoint.every):
        job.warnings.append("checkpoint.every is 0: an elastic job resumes from its last checkpoint after a lost "
                            "node, and without periodic ones that is its start; set checkpoint.every")
    if job.procs % p.tp:
        flag = "--gpus-per-node" if device == "cuda" else "--procs-per-node"
        job.warnings.append(f"parallel.tp = {p.tp} does not divide {flag} {job.procs}: tensor-parallel "
                            f"groups will span hosts, which is slow")
    if k8s and job.nodes > 1 and not job.pvc:
        job.warnings.append(f"the pods do not share {run_dir}: checkpoints need one filesystem that every rank "
                            f"sees; pass --pvc CLAIM (or add a shared volume to the manifest)")
    return job


def _default_name(config_path: str, k8s: bool) -> str:
    stem = Path(config_path).stem
    stem = re.sub(r"[^a-z0-9]+", "-", stem.lower()) if k8s else re.sub(r"[^A-Za-z0-9._-]+", "-", stem)
    return f"meshtrain-{stem}"[:_K8S_NAME_MAX].strip("-")


# --------------------------------------------------------------------------------------------- slurm

def emit_slurm(job: Job) -> str:
    """An sbatch script: one task (torchrun) per node, c10d rendezvous on the first node. On cuda it
    asks for the GPUs; on cpu for cores only (the task's cpus-per-task)."""
    cpus = job.procs * job.cpus_per_proc
    nodes = f"{job.min_nodes}-{job.nodes}" if job.elastic else job.nodes
    sbatch: list[tuple[str, Any]] = [("job-name", job.name), ("nodes", nodes), ("ntasks-per-node", 1)]
    sbatch += [("gpus-per-node", job.procs)] if job.device == "cuda" else []
    sbatch += [("cpus-per-task", cpus)]
    sbatch += [("partition", job.partition)] if job.partition else []
    sbatch += [("time", job.time or DEFAULT_TIME), ("output", "%x-%j.out")]
    q = shlex.quote
    # elastic: a failed node must not end the allocation (--no-kill), nor a failed task the others
    no_kill = ["#SBATCH --no-kill"] if job.elastic else []
    srun = f"srun --cpus-per-task={cpus}" + (" --kill-on-bad-exit=0" if job.elastic else "")
    elastic = ([f"    {elastic_launch.slurm_torchrun(job.max_restarts, job.rdzv_conf)} \\"] if job.elastic else [])
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH --{k}={v}" for k, v in sbatch),
        *no_kill,
        f"# meshtrain launch: {job.describe()}.",
        "# Submit with `sbatch THIS_FILE`; the log is <job-name>-<job-id>.out in the submit directory.",
        "set -euo pipefail",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        f"export MASTER_PORT={job.port}",
        f"export OMP_NUM_THREADS={job.cpus_per_proc}",
        *(['export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"'] if job.device == "cuda" else []),
        *([f"export {k}={v}  # a node that joins later gets the round's address (docs/training.md, Elastic)"
           for k, v in elastic_launch.ENV.items()] if job.elastic else []),
        f"mkdir -p {q(job.run_dir)}",
        # Slurm 22.05's srun does not take cpus-per-task from the job (23.11 does again): without it
        # the step, and every worker of the node, would get one core
        f"{srun} torchrun --nnodes {'$SLURM_NNODES' if not job.elastic else f'{job.min_nodes}:{job.nodes}'} "
        f"--nproc-per-node {job.procs} \\",
        "    --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id $SLURM_JOB_ID \\",
        *elastic,
        f"    -m meshtrain.train --config {q(job.config_path)} --out {q(job.run_dir)} {' '.join(job.overrides)}",
        ""])


# ----------------------------------------------------------------------------------------- kubernetes

def torchrun_k8s(job: Job) -> list[str]:
    """The container command: static rendezvous on the Master pod. The training operator sets
    MASTER_ADDR (the Master's service), MASTER_PORT (its ``pytorchjob-port``) and RANK (the pod's
    index: Master 0, Worker i -> i + 1) in every pod; Kubernetes expands ``$(VAR)``. Elastic: the
    rendezvous on worker 0 (``elastic_launch.k8s_torchrun``)."""
    if job.elastic:
        return [*elastic_launch.k8s_torchrun(job.name, job.min_nodes or 1, job.nodes, job.procs, job.max_restarts,
                                             job.rdzv_conf),
                "-m", "meshtrain.train", "--config", f"{CONFIG_DIR}/config.toml", "--out", job.run_dir, *job.overrides]
    return ["torchrun", "--nnodes", str(job.nodes), "--nproc-per-node", str(job.procs), "--node-rank", "$(RANK)",
            "--master-addr", "$(MASTER_ADDR)", "--master-port", "$(MASTER_PORT)", "-m", "meshtrain.train",
            "--config", f"{CONFIG_DIR}/config.toml", "--out", job.run_dir, *job.overrides]


def _replica(job: Job, replicas: int) -> dict[str, Any]:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL and shm need more than docker's 64 MB
               {"name": "config", "configMap": {"name": f"{job.name}-config"}}]
    if job.pvc:
        mounts.append({"name": "runs", "mountPath": RUNS_DIR})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": job.pvc}})
    container = {"name": "pytorch", "image": job.image, "command": torchrun_k8s(job),
                 "ports": [{"name": "pytorchjob-port", "containerPort": job.port}],
                 "env": [*([{"name": "NCCL_DEBUG", "value": "WARN"}] if job.device == "cuda" else []),
                         {"name": "OMP_NUM_THREADS", "value": str(job.cpus_per_proc)},
                         *([{"name": k, "value": v} for k, v in elastic_launch.ENV.items()] if job.elastic else [])],
                 # on cpu the pod asks for the cores its workers use, as the Slurm job does. Quantities
                 # are strings, the schema's type (the operator SDK's models drop or retype a number)
                 "resources": {"limits": {"nvidia.com/gpu": str(job.procs)}} if job.device == "cuda"
                 else {"requests": {"cpu": str(job.procs * job.cpus_per_proc)}}, "volumeMounts": mounts}
    return {"replicas": replicas, "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container], "volumes": volumes}}}


def emit_k8s(job: Job) -> str:
    """A ConfigMap with the config and a Kubeflow ``PyTorchJob`` (Master + nodes-1 Workers; elastic:
    MAX Workers and an ``elasticPolicy``), as one multi-document YAML for ``kubectl apply -f``."""
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{job.name}-config"},
                 "data": {"config.toml": job.config_text}}
    if job.elastic:  # the operator's elastic form: Workers only, the rendezvous on worker 0
        specs = {"Worker": _replica(job, job.nodes)}
    else:
        specs = {"Master": _replica(job, 1)}
        if job.nodes > 1:
            specs["Worker"] = _replica(job, job.nodes - 1)
    spec: dict[str, Any] = {"pytorchReplicaSpecs": specs}
    if job.elastic:
        spec["elasticPolicy"] = elastic_launch.k8s_elastic_policy(job.min_nodes or 1, job.nodes, job.max_restarts,
                                                                  job.rdzv_conf)
    if job.time:
        spec["runPolicy"] = {"activeDeadlineSeconds": seconds(job.time)}
    pytorchjob = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": job.name},
                  "spec": spec}
    head = [f"# meshtrain launch: {job.describe()}.",
            "# Needs the Kubeflow training operator; submit with `kubectl apply -f THIS_FILE`."]
    return "\n".join(head + to_yaml(configmap) + ["---"] + to_yaml(pytorchjob)) + "\n"


# ------------------------------------------------------------------------------------------------ YAML

def _str(dumper: Any, text: str) -> Any:
    """Multi-line text (the config in the ConfigMap) as a ``|`` block, as a person would write it;
    PyYAML falls back to a quoted scalar where a block would not read back exactly."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


def to_yaml(obj: Any) -> list[str]:
    """Block-style YAML lines for nested dicts and lists (PyYAML, keys in insertion order)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(str, _str)
    text = yaml.dump(obj, Dumper=Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True,
                     width=1 << 16)
    return text.splitlines()


# ------------------------------------------------------------------------------------------- command

def _write_atomic(path: str, text: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    _need(os.path.isdir(parent), f"--out {path!r}: directory {parent!r} does not exist; create it first")
    try:
        write_atomic(path, text)
    except OSError as e:
        raise ConfigError(f"--out {path!r}: cannot write it ({e.strerror}); choose another path") from None


EMIT = {"slurm": emit_slurm, "k8s": emit_k8s}


def main(args: argparse.Namespace) -> int:
    """Validate, then write the script / manifest to ``--out`` (atomically) or stdout; 2 on bad input."""
    try:
        job = build_job(args)
        text = EMIT[job.emit](job)
        if args.out:
            _write_atomic(args.out, text)
    except MeshtrainError as exc:
        print(f"meshtrain launch: error: {exc}", file=sys.stderr)
        return 2
    for w in job.warnings:
        print(f"meshtrain launch: warning: {w}", file=sys.stderr)
    if not args.out:
        sys.stdout.write(text)
        return 0
    submit = f"sbatch {args.out}" if job.emit == "slurm" else f"kubectl apply -f {args.out}"
    print(f"# wrote {args.out}: {job.name}, {job.describe()}; submit with "
          f"`{submit}`")
    return 0
