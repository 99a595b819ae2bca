"""Runs one collective: sequence number, metadata check, algorithm, timeout naming, recording.

The metadata check: before moving data, the members exchange a short JSON fingerprint (op,
sequence number, shapes, dtype, reduce op, root, algorithm) through the transport's ``exchange``.
Any difference raises ``CollectiveMismatch`` on every rank at once, naming the ranks and what they
passed, instead of a hang or silent garbage. It costs one small all-gather per collective (through
the store on the torch transport, a shared dict on the local one; see docs/comm.md), and can be
turned off with ``init(check=False)``. The same exchange tells, on timeout, exactly which ranks
never arrived. Groups on one host's shared memory skip that round: a 64-bit fingerprint of the
metadata travels with the first step of the shm collectives (or with one step of their protocol
ahead of any other algorithm) and is compared there; the full metadata is exchanged only when the
fingerprints differ, to name the ranks. The hierarchical collectives across hosts of the shm
transport carry it the same way (``hierarchical.Check``: inside each host, then 16 bytes between
the host leaders before any data crosses). A ``native`` call (torch.distributed's own op) runs the
store exchange beside the op instead of before it (``_native_checked_beside``). A torch-transport
group whose ranks share one host checks on a shared board instead of the store
(``check_board.py``): posted, then awaited and compared before meshtrain's algorithms move data;
torch's own op starts once every peer that has posted matches (``check_board.Ahead``).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from ..errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, MeshtrainError
from . import call_order, check_board, liveness, shake, tune
from .algorithms import hierarchical, native, shm_direct
from .algorithms.base import Ctx
from .communicator import Group, on_helper_thread
from .transport.base import FingerprintMismatch, PeerTimeout
from .work import Work


def fingerprint(payload: str) -> int:
    """A call's metadata as a signed 64-bit number, equal on every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(payload.encode(), digest_size=8).digest(), "little", signed=True)


_MEMO: dict[tuple[Any, ...], int] = {}  # a call's metadata (its items, in order) -> its fingerprint
_MEMO_MOST = 4096  # distinct calls kept; cleared beyond (shapes that vary call to call)
_SEQ_MIX = 0x9E3779B97F4A7C15  # odd: seq -> seq * _SEQ_MIX mod 2^64 is one-to-one


def call_fingerprint(meta: dict[str, Any], seq: int) -> int:
    """``fingerprint`` of a call's metadata (``call.call_meta`` and the op; not its sequence number),
    then ``seq`` mixed in by xor: two calls' fingerprints differ where their metadata or their seq
    does. The JSON and the hash, 15-20 us on a 2-core VM, are paid once per distinct call (a training
    step repeats the same few), not on every call; the lookup (the items as one tuple) and the mix
    are a fraction of a microsecond."""
    try:
        key: tuple[Any, ...] | None = tuple(meta.items())
        fp = _MEMO.get(key)  # type: ignore[arg-type]
    except TypeError:  # a value that cannot key a dict (a list): hashed every call
        key, fp = None, None
    if fp is None:
        fp = fingerprint(json.dumps(meta, sort_keys=True))
        if key is not None:
            if len(_MEMO) >= _MEMO_MOST:
                _MEMO.clear()
            _MEMO[key] = fp
    mixed = (fp ^ (seq * _SEQ_MIX)) & 0xFFFFFFFFFFFFFFFF
    return mixed - (1 << 64) if mixed >> 63 else mixed


def collective_tag(gid: int) -> int:
    """The p2p tag of a group's collectives (even); user p2p tags are odd."""
    return gid << 1


def p2p_tag(gid: int, tag: int) -> int:
    """The transport tag of a user's send/recv with ``tag`` on group ``gid``."""
    if not isinstance(tag, int) or not 0 <= tag < (1 << 20):
        raise ValueError(f"invalid tag {tag!r}: use an integer in 0..{(1 << 20) - 1}")
    return (((tag << 10) | gid) << 1) | 1


def _describe(meta: dict[str, Any]) -> str:
    parts = [str(meta.get("op"))]
    for key in ("shapes", "dtype", "redop", "root", "algorithm", "symmetric_offset"):
        if meta.get(key) is not None:
            parts.append(f"{key}={meta[key]}")
    return " ".join(parts)


def _payload(meta: dict[str, Any], seq: int, pairwise: Any) -> str:
    """What the store exchange carries of a call: its metadata with its sequence number, and an
    all_to_all's pairs, as JSON."""
    return json.dumps({"meta": dict(meta, seq=seq), "pair": pairwise}, sort_keys=True)


def _compare(name: str, seq: int, g: Group, payloads: list[str]) -> None:
    decoded = [json.loads(p) for p in payloads]
    metas = [json.dumps(d["meta"], sort_keys=True) for d in decoded]
    if any(m != metas[0] for m in metas):
        _raise_mismatch(name, seq, g, metas)
    if decoded[0]["pair"] is not None:  # all_to_all: rank i's send to j == rank j's recv from i
        for i, di in enumerate(decoded):
            for j, dj in enumerate(decoded):
                sent, expected = di["pair"][0][j], dj["pair"][1][i]
                if sent != expected:
                    raise CollectiveMismatch(
                        f"{name} #{seq} on group {g.gid}: rank {g.ranks[i]} sends {sent} elements to "
                        f"rank {g.ranks[j]}, which expects {expected}. Make input_tensor_list[j] on "
                        f"rank i match output_tensor_list[i] on rank j."
                    )


def _raise_mismatch(name: str, seq: int, g: Group, payloads: list[str]) -> None:
    by_meta: dict[str, list[int]] = {}
    for r, p in zip(g.ranks, payloads):
        by_meta.setdefault(p, []).append(r)
    lines = [f"ranks {ranks}: {_describe(json.loads(p))}" for p, ranks in by_meta.items()]
    raise CollectiveMismatch(
        f"{name} #{seq} on group {g.gid} (ranks {g.ranks}): ranks disagree on the call -- "
        + "; ".join(lines)
        + ". Every rank of a group must call the same collectives in the same order with "
        "matching shapes and dtypes."
    )


def run(g: Group, name: str, meta: dict[str, Any], body: Callable[[Ctx], Any], async_op: bool,
        nbytes: int, pairwise: Any = None, force_exchange: bool = False) -> Work | None:
    """Run ``body(ctx)`` as collective ``name`` on group ``g``; a Work if ``async_op`` else None.
    ``meta`` is the call's own ``call.call_meta`` (the op's name is added to it)."""
    if g.rank < 0:
        raise ValueError(
            f"rank {g.comm.rank} called {name} on group {g.gid} (ranks {g.ranks}) but is not a member"
        )
    if shake.ACTIVE is not None:  # timing perturbed on purpose (tests): before the seq is taken
        shake.ACTIVE.pause(g.comm.rank)
    seq = g.next_seq()
    meta["op"] = name  # the seq stays apart: call_fingerprint memoizes the rest
    if call_order.RECORDING:
        call_order.note(g, seq, name, meta)
    timed = g.tuner.take() if g.tuner else None  # auto is learning: time this call (comm/tune.py)
    if async_op:
        return g.submit(lambda: _execute(g, name, seq, meta, body, nbytes, timed, pairwise, force_exchange, False),
                        f"{name} #{seq} on group {g.gid}")
    g.drain()
    _execute(g, name, seq, meta, body, nbytes, timed, pairwise, force_exchange, not on_helper_thread())
    return None


def _execute(g: Group, name: str, seq: int, meta: dict[str, Any], body: Callable[[Ctx], Any], nbytes: int,
             timed: Any, pairwise: Any, force_exchange: bool, sync: bool) -> Any:
    """``run``'s call itself, on the caller's thread (``sync``) or the group's worker: recorded,
    checked, timed."""
    comm = g.comm
    start = tune.now() if timed else 0.0
    entry = comm.monitor.begin(g.gid, g.ranks, seq, name, meta["algorithm"], meta["shapes"], meta["dtype"],
                               nbytes, sync)  # (call_meta's strings and tuples)
    ctx = Ctx(comm.transport, g.ranks, g.rank, collective_tag(g.gid), time.monotonic() + g.timeout, g.pool,
              g.hosts)
    try:
        if (comm.check or force_exchange) and g.size > 1:
            result = _run_checked(g, name, seq, meta, body, ctx, pairwise, force_exchange)
        else:
            result = body(ctx)
    except PeerTimeout as exc:
        err = _timeout_error(name, seq, g, exc)
        comm.monitor.end(entry, ctx.sent_bytes, err)
        raise err from None
    except BaseException as exc:
        comm.monitor.end(entry, ctx.sent_bytes, exc)
        named = named_peer_loss(g, name, seq, exc)
        if named is not None:
            raise named from exc
        raise
    comm.monitor.end(entry, ctx.sent_bytes)
    if timed:
        tune.Tuner.record(timed, meta["algorithm"], tune.now() - start)
    return result


def _run_checked(g: Group, name: str, seq: int, meta: dict[str, Any], body: Callable[[Ctx], Any], ctx: Ctx,
                 pairwise: Any, force_exchange: bool) -> Any:
    """``body(ctx)`` with the metadata check (module docstring): fused into the shm steps, on the
    group's board, beside a native op or through the store before it. A PeerTimeout raised here
    names the ranks that never arrived where that can be told."""
    comm = g.comm
    deadline = ctx.deadline
    # A group in one host's shared memory checks a fingerprint in the step where its members
    # meet anyway: the shm collectives' first step, or one step of that protocol before others.
    # The hierarchical collectives across hosts of the shm transport check it in their steps.
    local = g.on_shared_memory  # shm_direct.usable(ctx), asked once per group
    # (an all_to_all's pairs differ by rank: the shm one checks them from its headers itself)
    own_pairs = pairwise is not None and local and meta.get("algorithm") == "shm"
    fused = not force_exchange and (pairwise is None or own_pairs) and (
        local or (meta.get("algorithm") == "hierarchical" and hierarchical.checks_itself(ctx, comm.node_size)))
    # A torch-transport group on one host checks on its shared board (comm/check_board.py).
    board = board_of(g) if not fused else None
    plain_native = not force_exchange and pairwise is None and meta.get("algorithm") == "native"
    beside = not fused and board is None and plain_native
    ahead = board is not None and plain_native
    # the JSON payload only where the store carries it (the fingerprints below are of meta alone;
    # an all_to_all's pairs differ by rank and go through the store)
    payload = _payload(meta, seq, pairwise) if not fused and board is None else ""
    try:
        if fused:
            ctx.fingerprint = call_fingerprint(meta, seq)
        elif board is not None:
            fp = call_fingerprint(meta, seq)
            board.post(seq, fp, deadline)
        elif not beside:
            payloads = comm.transport.exchange(f"c/{g.gid}/{seq}", g.ranks, payload, g.timeout)
            _compare(name, seq, g, payloads)
        try:
            if fused and local and meta.get("algorithm") != "shm":
                shm_direct.check_only(ctx)
            if ahead:  # torch's op as soon as every peer that posted matches (check_board.Ahead)
                result = _native_ahead(board, seq, fp, f"{name} #{seq}", deadline, body, ctx)
            else:
                if board is not None:  # meshtrain's algorithms over torch p2p: checked first
                    board.settle(seq, fp, deadline, f"{name} #{seq}")
                    if pairwise is not None or force_exchange:
                        _compare(name, seq, g, comm.transport.exchange(f"c/{g.gid}/{seq}", g.ranks,
                                                                       _payload(meta, seq, pairwise),
                                                                       g.timeout))
                result = _native_checked_beside(g, name, seq, payload, body, ctx) if beside else body(ctx)
        except FingerprintMismatch:  # every member got here: exchange the metadata to name who differs
            payloads = comm.transport.exchange(f"c/{g.gid}/{seq}", g.ranks, payload or _payload(meta, seq, pairwise),
                                               g.timeout)
            _compare(name, seq, g, payloads)
            raise CollectiveMismatch(f"{name} #{seq} on group {g.gid}: the ranks' metadata fingerprints "
                                     f"differ but the metadata they exchanged agrees. Calls of one group from two "
                                     f"threads at once do this (they share its buffers, in another order on each "
                                     f"rank): give each thread's calls a group of its own. Otherwise it is a bug: "
                                     f"please report it") from None
        finally:
            if board is not None:
                board.compared(seq)
        if fused and ctx.fingerprint is not None:
            raise RuntimeError(f"bug: {name} on shared memory never checked the call's fingerprint")
    except PeerTimeout as exc:
        if fused and ctx.fingerprint is not None:  # timed out before everyone had arrived
            raise PeerTimeout(f"ranks {exc.missing} never arrived", exc.missing, never_arrived=True) from None
        if fused and not local:  # across hosts: ask the store who called it at all
            raise _who_arrived(g, f"c/{g.gid}/{seq}", payload or _payload(meta, seq, pairwise), exc) from None
        raise
    return result


PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")
"""What torch's gloo says when a peer's connection ends (a killed process, a lost host)."""


def named_peer_loss(g: Group, name: str, seq: int, exc: BaseException) -> CollectiveError | None:
    """A torch op that failed on a closed connection does not say whose: ask the heartbeats, up to
    their naming bound (``liveness.naming_bound``), and name the lost rank in a ``CollectiveError``; None for
    any other error, or without heartbeats (ranks as threads). Without it such a rank's log could end
    (its exit follows its error within 3 s, ``launch.exit_within``) before the heartbeats named anyone."""
    live = g.comm.liveness
    text = str(exc)
    if live is None or isinstance(exc, MeshtrainError) or not any(s in text for s in PEER_GONE):
        return None
    why = live.why(None, wait=liveness.naming_bound())
    first = text.splitlines()[0] if text else type(exc).__name__
    return CollectiveError(f"{name} #{seq} on group {g.gid} (ranks {g.ranks}) failed: {first} -- "
                           + (why or "no heartbeat said which peer ended it"))


def _native_ahead(board: check_board.CheckBoard, seq: int, fp: int, what: str, deadline: float,
                  body: Callable[[Ctx], Any], ctx: Ctx) -> Any:
    """Run a native call checked on the board without waiting for late peers first: FingerprintMismatch
    if a peer that posted differs, before or while torch's op runs (``check_board.Ahead``)."""
    bad, everyone = board.verdict(seq, fp)
    if bad:
        raise FingerprintMismatch()
    if everyone:  # every peer posted this call, and it matches: checked before the op
        return body(ctx)
    with native.guarded(check_board.Ahead(board, seq, fp, deadline, what)):
        result = body(ctx)
    board.settle(seq, fp, deadline, what)  # a root whose op completed on its own sends alone
    return result


def board_of(g: Group) -> check_board.CheckBoard | None:
    """The group's check board, built on its first checked call; None where it cannot have one
    (another transport, ranks on several hosts)."""
    if not g.board_built:
        g.board_built = True
        if check_board.usable(g.comm.transport, g.hosts):
            g.board = check_board.build(g.comm.transport, g.ranks, g.rank, f"b/{g.gid}", g.timeout)
    return g.board


def _native_checked_beside(g: Group, name: str, seq: int, payload: str, body: Callable[[Ctx], Any],
                           ctx: Ctx) -> Any:
    """Run a native (torch.distributed) call with its metadata check beside it instead of before
    it: the store exchange runs on the communicator's check thread while torch's op is in flight,
    so its round trips (about 1 ms here, as much as a small gloo all-reduce) overlap the op. The op
    is waited for until it completes or the check fails; a mismatch is then named at once even
    where torch would hang. Unlike the check before the op, a mismatch leaves torch's group with an
    op that some ranks never joined: the process group is not usable after it (as in torch)."""
    comm = g.comm
    guard = native.Guard()
    t = comm.transport

    error: list[BaseException] = []

    def exchange() -> None:
        try:
            _compare(name, seq, g, t.exchange(f"c/{g.gid}/{seq}", g.ranks, payload, g.timeout, defer_delete=True))
        except BaseException as exc:  # noqa: BLE001 - a mismatch or timeout: stop waiting for the op
            error.append(exc)
            guard.fail()
        guard.checked.set()
        t.delete_stale()  # after the verdict, while the caller goes on

    comm.check_thread().submit(exchange)
    try:
        with native.guarded(guard):
            result = body(ctx)
    except native.Aborted:
        result = None
    guard.checked.wait()
    if error:
        raise error[0]  # the mismatch (or the PeerTimeout) the check found
    if guard.failed:
        raise CollectiveMismatch(f"bug: {name} #{seq}: the check beside it failed without a mismatch")
    return result


def _who_arrived(g: Group, key: str, payload: str, exc: PeerTimeout) -> PeerTimeout:
    """After a timeout in a call whose check rode its steps across hosts: exchange the metadata
    through the store with a short grace, so the error names the ranks that never called it (the
    others time out too and post theirs) -- or, if all did, the stall it was."""
    try:
        g.comm.transport.exchange(key, g.ranks, payload, min(g.timeout, ARRIVAL_GRACE_S))
    except PeerTimeout as missing:
        return missing
    return exc


# Seconds the ranks of a timed-out cross-host call wait for each other to post their arrival.
ARRIVAL_GRACE_S = 3.0


def _timeout_error(name: str, seq: int, g: Group, exc: PeerTimeout) -> CollectiveTimeout:
    me = g.comm.rank
    where = f"{name} #{seq} on group {g.gid} (ranks {g.ranks})"
    if exc.never_arrived:
        err = CollectiveTimeout(
            f"{where} timed out after {g.timeout:g}s on rank {me}: rank(s) {exc.missing} never "
            f"called it. Check that every rank of the group reaches this collective (a rank that "
            f"crashed, hangs, or skipped it), or raise the timeout."
        )
    else:
        err = CollectiveTimeout(
            f"{where} timed out after {g.timeout:g}s on rank {me}: {exc} (waiting for data "
            f"from rank(s) {exc.missing}). Every rank arrived, so a peer stalled or died mid-operation."
        )
    err.missing = exc.missing  # type: ignore[attr-defined]
    return err
