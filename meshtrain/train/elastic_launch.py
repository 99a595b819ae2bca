"""``meshtrain launch --nodes MIN:MAX``: the elastic form of the Slurm and Kubernetes jobs.

The job starts on up to MAX nodes (the config's layout fills MAX x processes per node) and goes on
while MIN are left: each node's torchrun gets ``--nnodes MIN:MAX``, ``--max-restarts`` and c10d
rendezvous settings, and the workers ``--elastic.enabled=true`` (the layout for the ranks a
rendezvous gives, ``elastic.py``). Every node count from MIN to MAX is checked here first: one the
layout cannot shrink to (tp x pp x cp larger than its ranks, a global batch its dp does not divide)
stops the emit with the fix, not the job hours later.

What each scheduler adds:

* Slurm: ``#SBATCH --nodes=MIN-MAX`` (the job may start with fewer nodes than MAX), ``--no-kill``
  (a failed node does not end the allocation) and ``srun --kill-on-bad-exit=0`` (nor does one
  failed task end the others). A node cannot join a running allocation, so on Slurm the job
  shrinks but grows back only when a node's torchrun is started again by hand.
* Kubernetes: the PyTorchJob's ``elasticPolicy`` (minReplicas, maxReplicas, maxRestarts,
  rdzvConf) and MAX ``Worker`` replicas, no Master (the operator's elastic form: the rendezvous is
  on worker 0, ``PET_RDZV_ENDPOINT``). A pod that fails is restarted (``OnFailure``) and its
  torchrun joins again: the job grows back.

Both export ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's default (the agents' store shared
with the workers) a node that joins a running job waits for the round's master address, which the
first node's agent published in the first round only, and fails after its timeout (torch 2.13).
"""

from __future__ import annotations

import copy
import re
import shlex
from typing import Any, Mapping

from ..errors import ConfigError

DEFAULT_MAX_RESTARTS = 10
"""torchrun --max-restarts of an elastic job: each failure costs one on the survivors (a planned
grow costs none, or one on an agent whose workers ended before it saw the new node)."""

RDZV_CONF = {"join_timeout": 900, "last_call_timeout": 5, "keep_alive_interval": 2, "keep_alive_max_attempt": 4}
"""c10d rendezvous settings of an elastic job. ``last_call_timeout``: once MIN nodes are in a new
round, wait this long for more (torch's default 30 s adds to every failure's downtime; a node that
misses a round joins the next, at the cost of one more restart). ``keep_alive_interval`` x
``keep_alive_max_attempt``: a dead node's rendezvous heartbeat expires after 8 s (default 15 s),
which a failure waits for; not much less, since a node waiting to join beats only every
interval + 1 s and is dropped when its beat looks expired. ``join_timeout``: the longest a node
waits for MIN nodes (a job with fewer nodes left than MIN fails after it: torchrun's
RendezvousTimeoutError)."""

ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""The agents' environment (see the module docstring)."""

_NODES = re.compile(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?")


def parse_nodes(value: Any) -> tuple[int, int]:
    """``--nodes``: ``N`` (a fixed job: (N, N)) or ``MIN:MAX``. ``ConfigError`` if malformed."""
    if isinstance(value, int):
        return value, value
    m = _NODES.fullmatch(str(value))
    if m is None:
        raise ConfigError(f"--nodes {value!r} is not a node count N or a range MIN:MAX; e.g. --nodes 4 or "
                          f"--nodes 2:4 (an elastic job: it goes on while 2 of its 4 nodes are left)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise ConfigError(f"--nodes must be >= 1, got {lo}")
    if lo > hi:
        raise ConfigError(f"--nodes {value}: MIN {lo} is larger than MAX {hi}; give --nodes MIN:MAX with MIN <= MAX")
    return lo, hi


def parse_rdzv_conf(text: str | None) -> dict[str, Any]:
    """``--rdzv-conf KEY=VALUE,...`` over ``RDZV_CONF``. ``ConfigError`` if malformed."""
    out: dict[str, Any] = dict(RDZV_CONF)
    for item in filter(None, (text or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE; e.g. --rdzv-conf "
                              f"last_call_timeout=5,join_timeout=600")
        out[key.strip()] = value.strip()
    return out


def rdzv_conf_text(conf: Mapping[str, Any]) -> str:
    """torchrun's ``--rdzv-conf`` value."""
    return ",".join(f"{k}={v}" for k, v in conf.items())


def check_node_counts(config: Any, min_nodes: int, max_nodes: int, procs: int, path: str) -> None:
    """``ConfigError`` unless the elastic layout rules find a layout for every node count from
    ``min_nodes`` to ``max_nodes`` (``procs`` ranks each), naming the first that fails, why, and the
    fixes (the smallest MIN that works, and the layout's own)."""
    from .elastic import effective_config

    cfg = copy.deepcopy(config)
    cfg.elastic.enabled = True
    bad: dict[int, str] = {}
    for n in range(min_nodes, max_nodes):  # max_nodes is the configured layout itself
        try:
            effective_config(cfg, n * procs)
        except ConfigError as exc:
            bad[n] = str(exc)
    if not bad:
        return
    first = min(bad)
    raise ConfigError(f"{path}: --nodes {min_nodes}:{max_nodes} lets the job go on with {first} node(s) = "
                      f"{first * procs} ranks, but {bad[first]} (node counts without a layout: {sorted(bad)})"
                      + (f"; or use --nodes {max(bad) + 1}:{max_nodes}" if max(bad) + 1 < max_nodes else ""))


def slurm_torchrun(max_restarts: int, conf: Mapping[str, Any]) -> str:
    """The torchrun flags an elastic Slurm job adds (its ``--nnodes`` is MIN:MAX)."""
    return f"--max-restarts {max_restarts} --rdzv-conf {shlex.quote(rdzv_conf_text(conf))}"


def k8s_elastic_policy(min_nodes: int, max_nodes: int, max_restarts: int, conf: Mapping[str, Any]) -> dict[str, Any]:
    """The PyTorchJob's ``spec.elasticPolicy``: what the operator turns into the pods' PET_* variables."""
    return {"rdzvBackend": "c10d", "minReplicas": min_nodes, "maxReplicas": max_nodes, "maxRestarts": max_restarts,
            "rdzvConf": [{"key": k, "value": str(v)} for k, v in conf.items()]}


def k8s_torchrun(job_name: str, min_nodes: int, max_nodes: int, procs: int, max_restarts: int,
                 conf: Mapping[str, Any]) -> list[str]:
    """The container's torchrun flags: c10d on worker 0, whose address the operator gives every pod
    as ``PET_RDZV_ENDPOINT`` (Kubernetes expands ``$(VAR)``)."""
    return ["torchrun", "--nnodes", f"{min_nodes}:{max_nodes}", "--nproc-per-node", str(procs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "$(PET_RDZV_ENDPOINT)", "--rdzv-id", job_name,
            "--max-restarts", str(max_restarts), "--rdzv-conf", rdzv_conf_text(conf)]


__all__ = ["DEFAULT_MAX_RESTARTS", "RDZV_CONF", "ENV", "parse_nodes", "parse_rdzv_conf", "rdzv_conf_text",
           "check_node_counts", "slurm_torchrun", "k8s_elastic_policy", "k8s_torchrun"]
