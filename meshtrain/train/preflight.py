"""What ``meshtrain train`` checks and says before its ranks start, and the remarks it adds after.

Before: the run against the machine (``check_machine``: ranks against cores, a refusal where the
ranks cannot start at all), the config's no-ops and traps (``config_notes``: a warmup longer than
the run, ZeRO with one rank to shard over, fp16 on a CPU), the data the run will see
(``data_summary``: files, documents, tokens, samples, epochs, repeats within a batch) and the
tokenizer's vocabulary against the one asked (``vocab_note``). After: the planner's prediction
against the measured step (``plan_lines``, ``plan_remark``). The launcher prints these once
(``report``, ``plan_lines``); under torchrun, where no launcher holds the data, rank 0 does
(``torchrun_report``). Each note is one line, ``# preflight: ...`` or ``# data: ...``, on
stderr beside the project's other notes (``# DataParallel bucket_cap_mb auto: ...``).

Everything here is a pure function of the config and what the launcher already holds, so the
tests call them directly; nothing starts a process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from ..config.schema import Config
    from .data import Corpus
    from .tokenizer import Tokenizer

STORE_RANKS_PER_CORE = 8
"""Worker processes per CPU core that can still start on one host. Each process's heartbeat
(``meshtrain/comm/liveness.py``) opens its own connection to the rendezvous store with a fixed
3 s timeout; ranks that start together on too few cores starve the store's thread, and the
connection fails with torch's ``DistNetworkError: The client socket has timed out after 3000ms``.
Measured on the project's 2-core VM (test model, dp-only): 16 processes start, 24, 32 and 64 do
not, and 32 start with the heartbeat off (``MESHTRAIN_HEARTBEAT=0``): the limit is that timeout,
not the store's listen backlog (4096) or the elastic launcher."""


PLAN_ERROR = {"profiled": 0.25, "roofline": 0.5}
"""The error the planner states for its step-time prediction (docs/plan.md), by how the blocks
were priced: with the blocks timed, within 25 % (0.91-0.93x on ``make run``, this VM's spread
about 20 %); by the roofline (cached calibration, GPU presets), within 50 % at best, and "off by a
few x" for small models on a CPU. Outside it, ``plan_remark`` says so."""


def note(text: str) -> str:
    """One line as the project prints its notes: ``# preflight: text``."""
    return f"# preflight: {text}"


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity, as a job scheduler sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_machine(n: int, threads: bool, on_cpu: bool, cores: int) -> list[str]:
    """The run of ``n`` ranks against a host of ``cores`` cores. Raises ``ConfigError`` where the
    ranks cannot start (``threads`` false: more worker processes than ``STORE_RANKS_PER_CORE``
    a core); returns the warning where they would time-share the cores (``on_cpu``: the ranks
    compute on them), else nothing."""
    limit = STORE_RANKS_PER_CORE * cores
    if not threads and n > limit:
        raise ConfigError(
            f"{n} worker processes cannot start on this host's {cores} CPU core(s): each rank's heartbeat "
            f"connection to the rendezvous store must be answered within 3 s (meshtrain/comm/liveness.py), and "
            f"{n} ranks starting at once on {cores} core(s) starve the store, so some fail with torch's "
            f"DistNetworkError 'The client socket has timed out after 3000ms' (at most {STORE_RANKS_PER_CORE} "
            f"processes a core start; measured on 2 cores: 16 do, 24 do not); use at most {limit} ranks here "
            f"(smaller parallel degrees), run them as threads (--comm.transport=local), or spread them over "
            f"hosts with torchrun")
    if on_cpu and n > cores:
        return [note(f"{n} ranks on {cores} CPU core(s): they time-share the cores ({n / cores:.1f} ranks a core), "
                     f"so a step takes about {n / cores:.1f}x the compute it would with a core per rank, and "
                     f"collectives wait on ranks the OS has descheduled; for speed use at most {cores} rank(s) here "
                     f"(smaller parallel degrees)")]
    return []


def on_cpu(config: "Config") -> bool:
    """True if the ranks compute on the CPU (``train.device`` cpu, or auto without CUDA)."""
    if config.train.device == "cpu":
        return True
    if config.train.device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def config_notes(config: "Config", cpu: bool) -> list[str]:
    """Warnings about settings that do nothing or cost much, for a run whose ranks compute on the
    CPU when ``cpu``: a warmup longer than the run (``lr_at`` clamps it to train.steps), ZeRO with
    one rank to shard over, fp16 on a CPU."""
    t, p = config.train, config.parallel
    out = []
    if t.warmup_steps > t.steps:
        out.append(note(f"train.warmup_steps = {t.warmup_steps} is longer than the run's train.steps = {t.steps}: "
                        f"warming up over all {t.steps} steps instead (the learning rate reaches train.lr = {t.lr} at "
                        f"the last step, with no decay); set train.warmup_steps <= {t.steps}, e.g. "
                        f"--train.warmup_steps={max(t.steps // 10, 1)}, to silence this"))
    shard = p.dp // max(p.dp_replicate, 1) * p.cp
    if p.zero_stage > 0 and shard == 1:
        out.append(note(f"parallel.zero_stage = {p.zero_stage} with dp = {p.dp} and cp = {p.cp}: ZeRO shards over "
                        f"dp x cp{' / dp_replicate' if p.dp_replicate > 1 else ''}, which is one rank here, so it "
                        f"shards nothing and saves no memory; set parallel.zero_stage = 0, or parallel.dp > 1"))
    if cpu and t.precision == "fp16":
        out.append(note("train.precision = 'fp16' on the CPU: torch's CPU kernels have no fast float16 path "
                        "(it runs many times slower than bf16); use "
                        "--train.precision=bf16 (the same memory, fp32's range, no loss scaling)"))
    return out


def _documents(corpus: "Corpus", tokenizer: "Tokenizer") -> int | None:
    """The documents the token cache counted when it was built (its meta.json), or None."""
    from .tokenizer import tokens_cache_path

    try:
        meta = json.loads(tokens_cache_path(corpus, tokenizer).with_name("meta.json").read_text())
        return int(meta["documents"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


REPEAT_SCAN_SAMPLES = 2_000_000
"""Count the batches that hold a sample twice only for runs of up to this many samples (the
loader's order is replayed, about a second at the limit); longer runs give the epochs alone."""


def repeated_batches(tokens: "np.ndarray", seq_len: int, global_batch: int, seed: int, steps: int) -> int | None:
    """How many of the run's ``steps`` global batches hold some sample more than once (a batch
    straddling two epochs, or one larger than an epoch), replaying the loader's order; None when
    the run is too long to replay (``REPEAT_SCAN_SAMPLES``)."""
    from .loader import GlobalBatchLoader

    loader = GlobalBatchLoader(tokens, seq_len, global_batch, seed=seed)
    if steps * global_batch <= loader.num_samples:  # less than an epoch: no sample comes back
        return 0
    if steps * global_batch > REPEAT_SCAN_SAMPLES:
        return None
    count = 0
    for _ in range(steps):
        ids = loader.next_ids()
        count += len(set(ids)) < len(ids)
    return count


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def data_summary(config: "Config", corpus: "Corpus", tokenizer: "Tokenizer", tokens: "np.ndarray") -> list[str]:
    """The data the run will train on, in one line (``# data: ...``): files, documents, tokens,
    samples, the epochs its steps take and the batches that repeat a sample; and a warning line
    where the run passes over the data many times."""
    t = config.train
    samples = (len(tokens) - 1) // t.seq_len if len(tokens) else 0
    docs = _documents(corpus, tokenizer)
    wanted = t.steps * t.global_batch
    epochs = wanted / max(samples, 1)
    files = len(corpus.files)
    on_disk = sum(f.stat().st_size for f in corpus.files)
    cut = f", cut to data.max_bytes = {corpus.max_bytes}" if corpus.max_bytes and on_disk > corpus.max_bytes else ""
    line = (f"# data: {corpus.name}: {files} file{'s' if files != 1 else ''} ({_size(on_disk)}{cut}), "
            f"{f'{docs:,} documents, ' if docs is not None else ''}{len(tokens):,} tokens -> {samples:,} samples of "
            f"{t.seq_len + 1} tokens; {t.steps} steps x {t.global_batch} = {wanted:,} samples = {epochs:.2f} epochs")
    repeats = repeated_batches(tokens, t.seq_len, t.global_batch, t.seed, t.steps) if samples else None
    if repeats:
        line += f"; {repeats} of {t.steps} batches hold a sample more than once"
    out = [line]
    if epochs > 2:
        out.append(note(f"the run passes over its data {epochs:.1f} times ({samples:,} samples for {wanted:,}), "
                        f"so its loss measures memorisation more than learning; give it more text (data.path, "
                        f"data.max_bytes = {config.data.max_bytes}) or fewer train.steps"))
    return out


def vocab_note(config: "Config", tokenizer: "Tokenizer") -> list[str]:
    """A note where the BPE trained on the corpus came out smaller than ``data.vocab_size`` asked
    (a small text has fewer merges to learn): the model's vocabulary is the tokenizer's."""
    d = config.data
    if d.tokenizer or tokenizer.vocab_size >= d.vocab_size:
        return []
    return [note(f"the BPE trained on the corpus has {tokenizer.vocab_size} tokens of the {d.vocab_size} asked "
                 f"(data.vocab_size): its sample of the text (data.tokenizer_sample_bytes = "
                 f"{d.tokenizer_sample_bytes}) has no more merges to learn; the model is built for "
                 f"{tokenizer.vocab_size} (padded), so set data.vocab_size = {tokenizer.vocab_size} to say so, or give "
                 f"it more text")]


def report(config: "Config", n: int, threads: bool, corpus: "Corpus", tokenizer: "Tokenizer",
           tokens: "np.ndarray", cores: int | None = None) -> list[str]:
    """The launcher's checks before its ``n`` ranks start: ``ConfigError`` where they cannot, else
    every note printed once to stderr (and returned)."""
    cpu = on_cpu(config)
    lines = check_machine(n, threads, cpu, host_cores() if cores is None else cores)
    lines += config_notes(config, cpu) + vocab_note(config, tokenizer) + data_summary(config, corpus, tokenizer, tokens)
    print_lines(lines)
    return lines


def torchrun_report(config: "Config", corpus: "Corpus", tokenizer: "Tokenizer", tokens: "np.ndarray",
                    local_world: int, cores: int | None = None) -> list[str]:
    """``report`` for rank 0 of a torchrun job, where the processes have started already: the same
    notes, with rank 0's host (``local_world`` processes) against its cores; no refusal."""
    cpu = on_cpu(config)
    lines = check_machine(local_world, True, cpu, host_cores() if cores is None else cores)
    lines += config_notes(config, cpu) + vocab_note(config, tokenizer) + data_summary(config, corpus, tokenizer, tokens)
    print_lines(lines)
    return lines


def print_lines(lines: Sequence[str]) -> None:
    """Each line to stderr, flushed (before the ranks' own output)."""
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def plan_remark(check: dict[str, Any]) -> str | None:
    """A note when the measured step differs from the planner's prediction by more than the error
    it states (``PLAN_ERROR``); None when it is within, or there is no prediction."""
    pred, got, p = check.get("predicted_step_s"), check.get("measured_step_s"), check.get("prediction")
    if not pred or not got or not isinstance(p, dict):
        return None
    compute = p.get("compute", "roofline")
    error = PLAN_ERROR.get(compute, PLAN_ERROR["roofline"])
    ratio = got / pred
    if 1 / (1 + error) <= ratio <= 1 + error:
        return None
    how = "slower" if ratio > 1 else "faster"
    where = ("a roofline misses the framework's per-op overhead of a small model on a CPU, and ranks that "
             "share cores; train.plan_check = 'profiled' times the blocks" if compute == "roofline" else
             "the blocks were timed with the cores free, so a busy host or ranks sharing cores read slower")
    return note(f"the measured step ({got:.4f} s) is {max(ratio, 1 / ratio):.1f}x {how} than the planner predicted "
                f"({pred:.4f} s, {compute}), beyond the {error:.0%} it states: {where}; see docs/plan.md "
                f"(\"Every run checks the planner\")")


def plan_lines(summary: dict[str, Any]) -> None:
    """After the run: its ``# planner:`` line (stdout) and ``plan_remark`` (stderr), once, by the
    process that launched the ranks (``meshtrain train``'s, or rank 0 under torchrun); nothing for a
    segment that trained no step (no check in ``summary``)."""
    from ..plan.run_check import plan_check_line

    if "measured_step_s" not in summary:
        return
    print(plan_check_line(summary), flush=True)
    remark = plan_remark(summary)
    if remark:
        print(remark, file=sys.stderr, flush=True)


__all__ = ["PLAN_ERROR", "STORE_RANKS_PER_CORE", "check_machine", "config_notes", "data_summary",
           "host_cores", "note", "on_cpu", "plan_lines", "plan_remark", "print_lines", "repeated_batches", "report", "torchrun_report", "vocab_note"]
