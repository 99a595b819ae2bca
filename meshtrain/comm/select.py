"""``algorithm="auto"``: the alpha-beta-gamma cost model (Thakur, Rabenseifner & Gropp 2005).

A message of n bytes costs α + n·β; reducing n bytes costs n·γ. A rank's messages are charged one
α each even when posted together (the direct algorithms): on host-driven transports every message
costs CPU time, and these are host-driven. Each algorithm's time is a formula
in α, β, γ, n and p; ``auto`` picks the cheapest. α, β and γ are fitted per group by a short
ping-pong between group ranks 0 and 1 plus a timed local reduction, on the first ``auto`` call that
needs them (never implicitly for ranks as threads: those keep their registry entry's ``cost_model``), and cached on disk. Every member uses group rank 0's values, so all ranks always choose alike.
On one host's shared memory the shm collectives are taken without pricing (see ``choose``).
A communicator's ``preferred_algorithm`` (the training config's ``comm.algorithm``) is taken
before either wherever it is valid for the op and group (``preferred``).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..files import cache_dir, write_json_atomic
from . import check_board
from .algorithms import REGISTRY, algorithms_for, shm_direct
from .algorithms.base import Ctx
from .transport import registry
from .transport.base import capabilities, on_shared_memory
from .types import ReduceOp, combine_

SEGMENT = 4 << 20  # ring.SEGMENT_BYTES


@dataclass
class CostModel:
    """Fitted link and compute constants: seconds per message, per byte sent, per byte reduced."""

    alpha: float
    beta: float
    gamma: float
    source: str = "default"

    def predict(self, op: str, algorithm: str, nbytes: int, p: int, nodes: int = 1) -> float:
        """Predicted seconds for ``op`` with ``algorithm`` on ``nbytes`` (see module docstring)."""
        a, b, g, n = self.alpha, self.beta, self.gamma, float(nbytes)
        if p <= 1:
            return 0.0
        lg = math.ceil(math.log2(p))
        pp = 1 << (p.bit_length() - 1)
        fold = 0.0 if pp == p else 2 * (a + n * b) + n * g
        f = (p - 1) / p
        if op == "all_reduce":
            return {
                "ring": 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
                "halving_doubling": 2 * math.log2(pp) * a + 2 * f * n * b + f * n * g + fold,
                "recursive_doubling": math.log2(pp) * (a + n * b + n * g) + fold,
                "tree": 2 * lg * (a + n * b) + lg * n * g,
                # whole, unsegmented messages: posting a large send copies it into the socket
                # before the receives progress, so sending and receiving do not overlap (measured:
                # 0.5x ring at 16 MB, p=2, where the plain formula predicted a tie)
                "direct": (p - 1) * (a + 2 * n * b + n * g),
                "hierarchical": (2 * math.ceil(math.log2(max(p // max(nodes, 1), 1)) or 0) * (a + n * b)
                                 + 2 * (nodes - 1) * a + 2 * n * b + n * g) if nodes > 1 else math.inf,
            }[algorithm]
        if op == "reduce":
            return {"tree": lg * (a + n * b + n * g),
                    "ring": 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
                    "direct": (p - 1) * (a + n * b + n * g)}[algorithm]
        if op == "broadcast":
            s = max(math.ceil(n / SEGMENT), 1)
            return {"tree": lg * (a + n * b),
                    "ring": (p - 2 + s) * (a + n / s * b),
                    "direct": (p - 1) * (a + n * b)}[algorithm]
        # hierarchical, with m = p / nodes ranks per node: a step inside the node, a ring of whole
        # nodes among the leaders, lg m broadcast steps of the other nodes' blocks inside the node
        lm, fn = math.ceil(math.log2(max(p // max(nodes, 1), 1))), (nodes - 1) / max(nodes, 1)
        if op == "all_gather":
            return {"ring": (p - 1) * a + f * n * b,
                    "recursive_doubling": lg * a + f * n * b + n * b / 4,
                    "hierarchical": ((nodes - 1 + 2 * lm) * a + (fn + lm * fn + 1 / nodes) * n * b)
                    if nodes > 1 else math.inf,
                    "direct": (p - 1) * a + f * n * b * 1.2}[algorithm]
        if op == "reduce_scatter":
            return {"ring": (p - 1) * a + f * n * (b + g),
                    "hierarchical": ((nodes - 1 + 2 * lm) * a + (lm + fn) * n * (b + g) + lm * n / nodes * b)
                    if nodes > 1 else math.inf,
                    "direct": (p - 1) * a + f * n * b * 1.2 + f * n * g}[algorithm]
        if op in ("gather", "scatter"):
            return {"tree": lg * a + f * n * b, "direct": (p - 1) * a + f * n * b}[algorithm]
        return a * p + n * b


@functools.lru_cache(maxsize=None)
def _model(costs: tuple[float, float, float]) -> CostModel:
    return CostModel(*costs)  # one object per entry: its groups share it


def default_model(kind: str) -> CostModel:
    """The model of transport ``kind`` before (or without) calibration: its registry entry's
    ``cost_model``; a kind not registered is priced as a network link (``registry.LINK_COSTS``)."""
    spec = registry.find(kind)
    return _model(spec.cost_model if spec is not None else registry.LINK_COSTS)



def cache_path() -> Path:
    """Where fitted models are cached: ``calibration.json`` in ``files.cache_dir()``
    ($MESHTRAIN_CACHE_DIR or ~/.cache/meshtrain)."""
    return cache_dir() / "calibration.json"


def _cache_key(group) -> str:
    t = group.comm.transport
    return f"{t.kind}:{getattr(t, 'backend', '')}:{group.size}:{len(set(group.hosts))}"


def _load_cached(key: str) -> dict | None:
    try:
        return json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError):
        return None


def _save_cached(key: str, value: Any) -> None:
    """Write ``value`` (JSON) under ``key`` in the cache file, atomically; a failure only costs a
    re-measurement next time."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = value
        write_json_atomic(path, data)
    except OSError:
        pass  # a cache we cannot write only costs a re-measurement


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return max(my - slope * mx, 1e-7), max(slope, 1e-13)


def measure(ctx: Ctx, sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 18, 1 << 21), reps: int = 5) -> CostModel | None:
    """Ping-pong between ranks 0 and 1 of ``ctx`` and a timed reduction; the fit on rank 0."""
    if ctx.size < 2 or ctx.rank > 1:
        return None
    buf = torch.zeros(max(sizes) // 4)
    times = []
    for nbytes in sizes:
        t = buf[: nbytes // 4]
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            if ctx.rank == 0:
                ctx.send(t, 1)
                ctx.recv(t, 1)
            else:
                ctx.recv(t, 0)
                ctx.send(t, 1 - ctx.rank)
            best = min(best, (time.perf_counter() - t0) / 2)
        times.append(best)
    if ctx.rank != 0:
        return None
    alpha, beta = _fit_line([float(s) for s in sizes], times)
    x, y = torch.ones(1 << 20), torch.ones(1 << 20)
    t0 = time.perf_counter()
    for _ in range(5):
        combine_(x, y, ReduceOp.SUM)
    gamma = (time.perf_counter() - t0) / 5 / (4 << 20)
    return CostModel(alpha, beta, gamma, source="measured")


def calibrate(group, force: bool = False) -> CostModel:
    """Fit (or load from cache) the group's cost model; collective over the group's members."""
    from . import runner

    group.drain()  # calibration messages must not interleave with in-flight async collectives
    key = _cache_key(group)
    cached = None if force else _load_cached(key)
    t = group.comm.transport
    group._cal_seq += 1  # its own counter: user-visible collective numbers stay 1, 2, 3, ...
    seq = group._cal_seq
    offers = t.exchange(f"cal/{group.gid}/{seq}", group.ranks, json.dumps(cached), group.timeout)
    offer0 = json.loads(offers[0])
    if offer0 is not None:  # group rank 0's cache decides for everyone
        group.cost_model = CostModel(**dict(offer0, source="cache"))
        group.choices.clear()  # the memo's keys hold the old model's id, which a new object may reuse
        return group.cost_model
    ctx = Ctx(t, group.ranks, group.rank, runner.collective_tag(group.gid),
              time.monotonic() + group.timeout, group.pool, group.hosts)
    fitted = measure(ctx)
    fits = t.exchange(f"cal/{group.gid}/{seq}/fit", group.ranks,
                      json.dumps(asdict(fitted) if fitted else None), group.timeout)
    fit0 = json.loads(fits[0])
    model = CostModel(**fit0) if fit0 else default_model(t.kind)
    if group.rank == 0 and fit0:
        _save_cached(key, asdict(model))
    group.cost_model = model
    group.choices.clear()
    return model


def _implicit_calibration(group, op: str) -> None:
    """``calibrate`` on the first auto call that needs the model, naming the trip it can cause: it
    meets only members that make an auto call too, so a member whose first call on the group
    differs (an explicit algorithm, another op) leaves it waiting."""
    from ..errors import CollectiveTimeout
    from .transport.base import PeerTimeout

    try:
        calibrate(group)
    except PeerTimeout as exc:
        err = CollectiveTimeout(
            f"{op} with algorithm='auto' on group {group.gid} (ranks {group.ranks}): its first auto call fits "
            f"the cost model with every member (calibration), and rank(s) {exc.missing} did not join within "
            f"{group.timeout:g}s. Make every member's first auto call on the group at the same point, or "
            "call meshtrain.comm.calibrate(group) on every member first, or pass algorithm= explicitly.")
        err.missing = exc.missing  # type: ignore[attr-defined]
        raise err from None


def preferred(group, op: str) -> str | None:
    """The communicator's ``preferred_algorithm`` if it can run ``op`` on ``group``, else None.

    Valid means offered for ``op`` on the group's transport (``algorithms_for``: "native" only on
    torch, "shm" only on shm) and, for "shm", every member on this host's shared memory (a group
    spanning hosts cannot use it)."""
    name = group.comm.preferred_algorithm
    if name is None or name not in algorithms_for(op, group.comm.transport.kind):
        return None
    if name == "shm" and not (on_shared_memory(group.comm.transport, group.ranks) and group.size > 1):
        return None
    return name


# Sizes (bytes, [from, below)) where auto takes gloo's own collective on the torch transport over
# gloo; elsewhere the cost model picks one of meshtrain's. Measured with the check on its board
# (comm/check_board.py; docs/benchmarks.md, session 12):
# - groups of two, every size: each step of meshtrain's algorithms is a gloo send/recv pair, and
#   one such message cost more than gloo's whole collective below 1 MB (auto at 0.26-0.64x gloo's
#   all_reduce, 0.30-0.77x its all_gather and reduce_scatter, where gloo's own ran 0.7-1.2x);
# - larger groups: all_reduce from 1 MB (gloo's ring in C++ against meshtrain's Python algorithms:
#   auto 0.54-0.68x gloo at 2-8 MB on four ranks), all_gather below 1 MB (auto 0.69-0.80x; gloo's
#   own 0.95-1.19x there but 0.71-0.90x from 1 MB). reduce_scatter stays meshtrain's (1.1-1.6x).
# - session 14, with native's waits looking before they block (native.finish): all_gather at 1 MB on
#   four ranks, gloo's own through meshtrain 3.5-4.0 ms against recursive doubling's 4.4-5.5 ms
#   (ring 4.5-4.6); from 2 MB ring as fast or faster. So native below 2 MB.
# The last two rules need the check before the data (a board, one host): checked beside gloo's op
# (across hosts), a mismatched call can end a process inside gloo before the check names it.
NATIVE_FROM_GLOO = {"all_reduce": (1 << 20, math.inf)}
NATIVE_FROM_GLOO_PAIR = {"all_reduce": (0, math.inf), "all_gather": (0, math.inf), "reduce_scatter": (0, math.inf)}
NATIVE_FROM_GLOO_BOARD = {"all_reduce": (1 << 20, math.inf), "all_gather": (0, 2 << 20)}

# Sizes (bytes) from which auto takes hierarchical on a group spanning hosts with shm inside each
# (below 1 MiB the model's recursive doubling or tree did as well for all_reduce).
HIERARCHICAL_FROM = {"all_reduce": 1 << 20, "all_gather": 0, "reduce_scatter": 0}


def _hosts_on_shm(group) -> bool:
    """True if ``group`` spans hosts on the shm transport (gloo between them) and some host holds
    two or more of its ranks, so hierarchical's steps inside a host run on shared memory."""
    t = group.comm.transport
    return (capabilities(t).shared_memory and group.size > 1 and not on_shared_memory(t, group.ranks)
            and 1 < len(set(group.hosts)) < group.size)


def choose(group, op: str, nbytes: int, native_ok: bool = True) -> str:
    """The cheapest algorithm for ``op`` on ``nbytes`` in ``group`` (same answer on every member),
    or the communicator's preferred algorithm where it is valid for ``op`` on ``group``.
    ``native_ok=False`` (a dtype torch's collectives cannot move) keeps to meshtrain's algorithms.
    Answers are kept per group (``Group.choices``), keyed by everything here that can change: the
    preferred algorithm, the cost model and whether the board is built."""
    memo = getattr(group, "choices", None)
    if memo is None:
        return _choose(group, op, nbytes, native_ok)
    algo = memo.get(_memo_key(group, op, nbytes, native_ok))
    if algo is None:
        algo = _choose(group, op, nbytes, native_ok)
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        memo[_memo_key(group, op, nbytes, native_ok)] = algo  # after calibration: the model it was chosen with
    return algo


def _memo_key(group, op: str, nbytes: int, native_ok: bool) -> tuple:
    return (op, nbytes, native_ok, group.comm.preferred_algorithm, id(group.cost_model), group.board_built,
            group.board is None)


MEMO_SIZE = 4096


def _choose(group, op: str, nbytes: int, native_ok: bool) -> str:
    pref = preferred(group, op)
    if pref is not None:  # the user's choice (the training config's comm.algorithm) beats the model
        return pref
    t = group.comm.transport
    caps = capabilities(t)
    native_ok = native_ok and caps.native_collectives
    if native_ok and "nccl" in str(getattr(t, "backend", "")) and "native" in algorithms_for(op, t.kind):
        # NCCL's own collectives run on the GPU (kernels over NVLink/InfiniBand, no host round
        # trips); meshtrain's Python algorithms over NCCL send/recv only add launches.
        return "native"
    if native_ok and "native" in algorithms_for(op, t.kind):
        rules = NATIVE_FROM_GLOO
        if check_board.checks_first(group):
            rules = NATIVE_FROM_GLOO_PAIR if group.size == 2 else NATIVE_FROM_GLOO_BOARD
        lo, hi = rules.get(op, (math.inf, math.inf))
        if lo <= nbytes < hi:
            return "native"  # gloo's own where it was measured faster (NATIVE_FROM_GLOO)
    if op in shm_direct.ALGORITHMS and on_shared_memory(t, group.ranks) and group.size > 1:
        # One host's shared memory: the shm collectives beat every point-to-point algorithm on
        # this transport at every size measured (docs/benchmarks.md, "auto on the shm
        # transport"), while the model, fitted from a one-way ping-pong, prices those algorithms
        # 2-2.5x too cheaply there (a ring step both sends and receives, so each core copies
        # every byte twice, and each message pays the transport's per-message work).
        return "shm"
    if nbytes >= HIERARCHICAL_FROM.get(op, math.inf) and _hosts_on_shm(group):
        # Across hosts with shared memory inside each (transport "auto" off CUDA): hierarchical,
        # whose steps inside a host run the shm collectives, beat the model's choices for these ops
        # and sizes on 2 simulated hosts x 2 ranks (docs/benchmarks.md, "Across 2 simulated
        # hosts"): the model prices every link alike (fitted between group ranks 0 and 1, often
        # on one host) and chose halving-doubling, recursive doubling or ring: 0.7-0.9x gloo for
        # all_reduce and all_gather at 1-16 MB, where hierarchical ran 1.0-1.45x faster.
        return "hierarchical"
    names = [n for n in REGISTRY[op] if REGISTRY[op][n] is not None or op == "barrier"]
    if len(names) == 1 or group.size == 1:
        return names[0]
    if group.cost_model is None:
        if caps.ranks_are_threads:
            # Ranks as threads of one process: no implicit calibration. Its exchange is a hidden
            # collective that blocks a thread playing every rank in turn (the seed's operators),
            # and a ping-pong between threads measures the GIL rather than a link. The defaults
            # are the same on every rank; calibrate() still fits the model when asked.
            group.cost_model = default_model(t.kind)
        else:
            _implicit_calibration(group, op)
    nodes = len(set(group.hosts))
    model: CostModel = group.cost_model
    return min(names, key=lambda n: (model.predict(op, n, nbytes, group.size, nodes), n))


def candidates(group, op: str, nbytes: int, native_ok: bool, static: str) -> list[str]:
    """What online selection (``tune``) tries for ``op`` on ``nbytes``: ``static`` (this module's
    choice) first, torch's own collective where the transport offers it for the dtype, the shm
    collectives on one host's shared memory, hierarchical across hosts, then meshtrain's algorithms
    by the model's price (the group's fitted model, else its transport's default: no calibration
    is started for this), at most ``tune.MAX_CANDIDATES`` in all. Only ``static`` where the user's
    preferred algorithm applies or on NCCL (torch's own kernels)."""
    from .tune import MAX_CANDIDATES

    t = group.comm.transport
    if preferred(group, op) is not None or "nccl" in str(getattr(t, "backend", "")):
        return [static]
    valid = algorithms_for(op, t.kind)
    nodes = len(set(group.hosts))
    out = [static]
    if native_ok and capabilities(t).native_collectives and "native" in valid and _native_safe(group, op, nbytes):
        out.append("native")
    if "shm" in valid and group.on_shared_memory:
        out.append("shm")
    if "hierarchical" in valid and _hosts_on_shm(group) and op in HIERARCHICAL_FROM:
        out.append("hierarchical")
    model = group.cost_model or default_model(t.kind)
    own = [n for n in REGISTRY[op] if REGISTRY[op][n] is not None and n in valid and n != "hierarchical"]
    own.sort(key=lambda n: (model.predict(op, n, nbytes, group.size, nodes), n))
    seen: list[str] = []
    for n in out + own:
        if n not in seen:
            seen.append(n)
    return seen[:MAX_CANDIDATES]


def _native_safe(group, op: str, nbytes: int) -> bool:
    """True where torch's own collective may run under the metadata check: the check off, or run
    before the data (a board: ``check_board.checks_first``), or where ``NATIVE_FROM_GLOO`` already
    takes it with the check beside. Elsewhere a mismatched call could end a process inside gloo
    before the check names it (see the rules above), so online selection does not try it there."""
    if not group.comm.check or check_board.checks_first(group):
        return True
    lo, hi = NATIVE_FROM_GLOO.get(op, (math.inf, math.inf))
    return lo <= nbytes < hi


def crossovers(model: CostModel, op: str, p: int, nodes: int = 1,
               lo: int = 1 << 6, hi: int = 1 << 28, extra: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """Sizes (bytes, doubling from ``lo``) where the cheapest algorithm changes, with the new winner;
    ``extra`` adds transport-specific algorithms (``("shm",)`` on the shm transport)."""
    names = list(REGISTRY[op]) + [e for e in extra if e != "shm" or op in shm_direct.ALGORITHMS]
    if "shm" in names and p > 1:  # what choose() does on one host's shared memory
        return [(lo, "shm")]
    out: list[tuple[int, str]] = []
    prev = None
    n = lo
    while n <= hi:
        best = min(names, key=lambda a: model.predict(op, a, n, p, nodes))
        if best != prev:
            out.append((n, best))
            prev = best
        n *= 2
    return out
