"""A layout: the (dp, pp, cp, tp) degrees, expert parallelism (ep) carved out of dp_shard x cp, plus
the settings that change its cost (micro-batches, pipeline schedule, ZeRO stage and CPU offload,
activation checkpointing, precision), parsed and validated.

Validation raises ConfigError with the nearest valid choice, so the CLI can print it and exit 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..config.dims import positive_int
from ..config.parallel import OFFLOAD_MODES, check_expert_parallel, check_offload
from ..errors import ConfigError
from ..parallel.pipeline.schedule import SCHEDULES
from .architectures import Arch

AC_MODES = ("none", "selective", "op", "full")
"""none; selective: meshtrain's (every 2nd block fully checkpointed); op: torchtitan's selective op
(matmul and attention outputs kept, element-wise ops recomputed); full: every block recomputed."""
PRECISIONS = ("fp32", "bf16", "fp8")
ATTN_KERNELS = ("sdpa", "cudnn", "triton", "unfused")
"""sdpa: torch's scaled_dot_product_attention (FlashAttention-2 inside); cudnn: cuDNN fused attention
(Transformer Engine, Megatron); triton: a FlashAttention-1-class kernel (llm-foundry's Triton
FlashAttention, ``attn_impl: triton``, which MosaicML's benchmarks ran); unfused: the s x s scores
materialised (Megatron-LM before FlashAttention: ``attention_unfused.py``)."""
RANK_ORDERS = ("meshtrain", "megatron")
"""meshtrain: ranks laid out (dp, pp, cp, tp), tp innermost (``meshtrain.mesh``); megatron: pipeline
outermost (Megatron-LM's tp-cp-ep-dp-pp), for pricing its published runs."""


@dataclass(frozen=True)
class Layout:
    """Degrees of the (dp, pp, cp, tp) mesh and the settings priced with them."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    microbatches: int = 1
    """Micro-batches per step per data-parallel rank."""
    virtual: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    schedule: str = "1f1b"
    zero_stage: int = 0
    ac: str = "none"
    precision: str = "bf16"
    sequence_parallel: bool = True
    """Split the residual stream over tp (Megatron SP); only meaningful with tp > 1."""
    compile: bool = False
    """Element-wise ops fused (torch.compile) rather than run eagerly."""
    dp_replicate: int = 1
    """Of dp, the replicas of ZeRO's shards (HSDP): ZeRO shards over dp / dp_replicate x cp and
    all-reduces each shard's gradient over the replicas."""
    ep: int = 1
    """Expert-parallel degree (MoE models): the routed experts split over ep ranks carved out of
    dp_shard x cp (a multiple of cp dividing dp_shard x cp); adds no ranks."""
    ep_overlap: bool = False
    """The ep all-to-alls hidden behind another micro-batch's compute, as Megatron's
    ``overlap_moe_expert_parallel_comm`` does; meshtrain does not. For pricing a peer's run."""
    rank_order: str = "meshtrain"
    """How ranks map to nodes: meshtrain's (dp, pp, cp, tp) or Megatron's pipeline-outermost order."""
    overlap_param_gather: bool = False
    """ZeRO-1/2's all-gather of the updated weights done in the compute dtype behind the next step's
    forward, bucket by bucket, as Megatron's distributed optimizer does with
    ``--overlap-param-gather``; meshtrain gathers the fp32 weights after the step. Only meaningful
    with zero 1 or 2; for pricing a peer's published run (meshtrain's own runs cannot set it)."""
    p2p_overlap: bool = False
    """The pipeline's sends and receives run beside the next chunk's compute (Megatron's
    ``overlap_p2p_comm``, which Megatron-LM and Megatron-Bridge turn on with the interleaved schedule):
    only what a transfer takes beyond one chunk's compute is exposed. meshtrain waits for each
    transfer. For pricing a peer's run."""
    offload: str = "none"
    """ZeRO CPU offload (``parallel.offload``): "optimizer" keeps the fp32 masters and AdamW state in
    host memory and steps on the CPUs; "params" (ZeRO-3) also ZeRO-3's parameter shards."""
    uneven: bool = False
    """Pipeline stages may hold different numbers of layers (n_layers not divisible by pp x v), as
    torchtitan and meshtrain train split them; Megatron refuses such a split, and so does the planner
    unless this is set. The busiest pipeline rank is priced with ceil(n_layers / pp) layers."""
    async_tp: bool = False
    """Async TP (torchtitan's ``enable_async_tensor_parallel``, Megatron's ``--tp-comm-overlap``): each
    sequence-parallel all-gather and reduce-scatter is cut into tp pieces passed around the tp group while
    the matmul that consumes (or produces) them runs on the pieces already there, so only what exceeds
    that matmul is exposed. Needs tp > 1 with sequence parallelism; meshtrain's runtime has no async TP,
    so ``--search`` tries it only when told the runtime does (``--async-tp``)."""
    async_tp_backward: bool = False
    """Async TP in the backward too, as Transformer Engine's userbuffers run it under Megatron's
    ``--tp-comm-overlap`` ("overlapping is done for the linear layers wherever possible during the forward
    and the backward pass", MCore's ``ModelParallelConfig``): the output gradient's all-gather beside the
    row-parallel dgrad GEMM (ring exchange), the saved input's all-gather beside the column-parallel
    dgrad GEMMs and their input gradient's reduce-scatter beside their wgrad GEMMs (bulk overlaps,
    ``step.TE_COMM_SMS`` SMs each). Needs ``async_tp``; for pricing a peer's run."""
    cp_allgather: bool = False
    """Ring attention's K/V exchanged as one all-gather before the first step (PyTorch's
    ``_RotateMethod.ALL_GATHER``, torchtitan's default) instead of passed step by step: hidden behind
    the first step's attention only. For pricing a peer's run."""
    attn_kernel: str = "sdpa"
    """The attention kernel: "sdpa" (torch's scaled_dot_product_attention, whose flash backend is
    FlashAttention-2: meshtrain, torchtitan), "cudnn" (cuDNN's fused attention, which Transformer Engine
    and so Megatron run: ``fused_attention_speedup`` faster on Hopper), "triton" (llm-foundry's
    Triton FlashAttention, the FlashAttention-1 algorithm: ``fa1_attention_efficiency``) or "unfused"
    (Megatron-LM's attention before FlashAttention, scores materialised: ``attention_unfused.py``)."""
    kv_repeat: bool = False
    """Grouped-query K and V repeated to every query head before the attention call (torchtitan's Llama at
    9dec370: ``repeat_kv`` before ``F.scaled_dot_product_attention``), so ring attention moves and merges
    full-width K/V, and the repeat copies them once a block. meshtrain passes the kv heads (its ring
    sends them as they are). For pricing a peer's run."""
    loss_compiled: bool = False
    """The cross-entropy fused into one kernel each way: under ``torch.compile`` (torchtitan's
    ``build_cross_entropy_loss`` with ``--training.compile``, e7c0cae; at 9dec370 it was commented out)
    or a fused loss kernel (llm-foundry's default ``fused_crossentropy``, flash-attn's): the up-cast and
    the log-softmax fuse into the loss's kernels, so only the logits and their gradient are held (``memory.
    loss_bytes_per_vocab``) and it makes one pass over them each way (``compute.loss_bytes_per_logit``).
    meshtrain's loss runs eagerly. For pricing a peer's run."""
    fsdp_pp: bool = False
    """PyTorch FSDP2 under a pipeline (torch.distributed.pipelining, torchtitan): the stage's unsharded
    weights and its unsharded fp32 gradients are kept across micro-batches and reduce-scattered once at
    the last backward. meshtrain's ZeRO-3 reduce-scatters each micro-batch's gradients. Memory only."""

    @property
    def dp_shard(self) -> int:
        """The dp ranks one ZeRO shard group holds (dp / dp_replicate)."""
        return self.dp // self.dp_replicate

    @property
    def ep_room(self) -> int:
        """Ranks an expert-parallel group may span: dp_shard x cp (meshtrain), or tp x dp_shard x cp
        under Megatron's order, whose expert grid folds ep over the tensor-parallel ranks too (expert
        tensor parallelism 1: EP x expert-DP = TP x DP x CP)."""
        return self.dp_shard * self.cp * (self.tp if self.rank_order == "megatron" else 1)

    @property
    def ep_in_dp(self) -> int:
        """The part of ep taken from dp_shard (the rest of ep is the whole cp group, and under
        Megatron's folding possibly tp ranks)."""
        share = self.ep // self.cp if self.ep > 1 else 1
        return math.gcd(share, self.dp_shard) if self.dp_shard % share else share

    @property
    def dp_shard_in_ep(self) -> int:
        """Mesh axis: the dp_shard ranks inside one expert-parallel group."""
        return self.ep_in_dp

    @property
    def dp_shard_mod_ep(self) -> int:
        """Mesh axis: the dp_shard ranks outside an expert-parallel group (experts' ZeRO shards)."""
        return max(1, self.dp_shard // self.ep_in_dp)

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO shards the experts over: tp x dp_shard x cp / ep, their expert-data-parallel
        shard group (experts are not tensor-parallel: tp ranks hold the same experts unless Megatron's
        folding spreads ep over them)."""
        return self.tp * self.dp_shard * self.cp // self.ep

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO shards parameters / gradients / optimizer state over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on (needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1

    def label(self) -> str:
        """A short, parseable name: ``dp=8,tp=8,pp=8,cp=1,m=32,v=2,1f1b,zero=1,ac=full``."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"cp={self.cp}"]
        if self.pp > 1:
            parts += [f"m={self.microbatches}", self.schedule] + ([f"v={self.virtual}"] if self.virtual > 1 else [])
        elif self.microbatches > 1:
            parts.append(f"m={self.microbatches}")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("sp=0")
        if self.uneven and self.pp * self.virtual > 1:
            parts.append("uneven=1")
        if self.p2p_overlap and self.pp > 1:
            parts.append("ppo=1")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.ep_overlap and self.ep > 1:
            parts.append("epo=1")
        if self.rank_order != "meshtrain":
            parts.append(f"order={self.rank_order}")
        if self.dp_replicate > 1:
            parts.append(f"rep={self.dp_replicate}")
        if self.overlap_param_gather and self.zero_stage in (1, 2):
            parts.append("opg=1")
        if self.async_tp and self.tp > 1:
            parts.append("atp=1")
        if self.async_tp_backward and self.tp > 1:
            parts.append("atpb=1")
        if self.cp_allgather and self.cp > 1:
            parts.append("cpag=1")
        if self.attn_kernel != "sdpa":
            parts.append(f"attn={self.attn_kernel}")
        if self.kv_repeat:
            parts.append("kvrep=1")
        if self.loss_compiled:
            parts.append("closs=1")
        if self.fsdp_pp and self.zero_stage == 3 and self.pp > 1:
            parts.append("fsdp=1")
        parts += [f"zero={self.zero_stage}"] + ([f"offload={self.offload}"] if self.offload != "none" else [])
        return ",".join(parts + [f"ac={self.ac}"])


_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "m": "microbatches", "microbatches": "microbatches",
         "v": "virtual", "virtual": "virtual", "zero": "zero_stage", "zero_stage": "zero_stage", "ac": "ac",
         "schedule": "schedule", "precision": "precision", "sp": "sequence_parallel", "rep": "dp_replicate",
         "dp_replicate": "dp_replicate", "opg": "overlap_param_gather",
         "overlap_param_gather": "overlap_param_gather", "ep": "ep", "epo": "ep_overlap", "ep_overlap": "ep_overlap",
         "order": "rank_order", "rank_order": "rank_order", "offload": "offload", "uneven": "uneven",
         "atp": "async_tp", "async_tp": "async_tp", "atpb": "async_tp_backward",
         "async_tp_backward": "async_tp_backward", "cpag": "cp_allgather", "cp_allgather": "cp_allgather",
         "attn": "attn_kernel", "attn_kernel": "attn_kernel", "fsdp": "fsdp_pp", "fsdp_pp": "fsdp_pp",
         "kvrep": "kv_repeat", "kv_repeat": "kv_repeat", "closs": "loss_compiled", "loss_compiled": "loss_compiled",
         "ppo": "p2p_overlap", "p2p_overlap": "p2p_overlap"}
_FLAGS = ("sequence_parallel", "overlap_param_gather", "ep_overlap", "uneven", "async_tp", "async_tp_backward",
          "cp_allgather", "fsdp_pp", "kv_repeat", "loss_compiled", "p2p_overlap")
"""Layout fields written 1 or 0 (true/false, on/off)."""

MAX_GPUS = 1 << 20
"""The most GPUs the planner prices (the largest published runs use about 10^5): beyond it --search's
enumeration would run for minutes, and such a number is a typo."""
MAX_BATCH = MAX_SEQ = 1 << 24
"""The largest --global-batch (sequences) and --seq (tokens) the planner prices, for the same reason."""


def parse_layout(text: str, **defaults) -> Layout:
    """``"dp=32,tp=8"`` (unnamed degrees are 1; a bare schedule name sets the schedule) -> Layout,
    with ``defaults`` (Layout fields) for what the text does not set."""
    values: dict = dict(defaults)
    given: dict[str, str] = {}  # field -> the part of the text that set it
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = ("schedule", "=", part) if part in SCHEDULES else part.partition("=")
        if not sep or key not in _KEYS:
            raise ConfigError(f"--layout {text!r}: cannot read {part!r}; write key=value with keys "
                              f"{', '.join(sorted(set(_KEYS)))}, e.g. dp=32,tp=8")
        field = _KEYS[key]
        if field in given:  # the last would silently win: say which one the user meant
            raise ConfigError(f"--layout {text!r}: {given[field]!r} and {part!r} both set {field}; keep one")
        given[field] = part
        if field in ("ac", "schedule", "precision", "rank_order", "offload", "attn_kernel"):
            values[field] = raw
        elif field in _FLAGS:
            flag = raw.lower()
            if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ConfigError(f"--layout {text!r}: {key} takes 1 or 0 (true/false, on/off), got {raw!r}")
            values[field] = flag in ("1", "true", "yes", "on")
        else:
            try:
                values[field] = int(raw)
            except ValueError as e:
                raise ConfigError(f"--layout {text!r}: {key} must be an integer, got {raw!r}") from e
    return Layout(**values)


def tp_splits(arch: Arch, tp: int) -> bool:
    """True if tp splits the heads, the kv heads and the MLP width (and the shared experts' width)
    evenly (as meshtrain requires); routed experts are not tensor-parallel."""
    return arch.n_heads % tp == 0 and arch.n_kv_heads % tp == 0 and arch.ffn_dim % tp == 0 and \
        arch.shared_ffn % tp == 0


def ep_choices(arch: Arch, layout: Layout) -> list[int]:
    """Every valid ep for ``layout``'s other degrees: a multiple of cp dividing ``Layout.ep_room`` and
    the number of routed experts (just 1 for a dense model)."""
    if not arch.is_moe:
        return [1]
    room = layout.ep_room
    return [e for e in range(1, room + 1) if room % e == 0 and arch.n_experts % e == 0 and
            (e == 1 or e % layout.cp == 0)]


def validate_ep(layout: Layout, arch: Arch) -> None:
    """Raise ConfigError naming the valid choices if ``layout.ep`` cannot split ``arch``'s experts."""
    if layout.ep < 1:
        raise ConfigError(f"layout ep={layout.ep} must be >= 1")
    if layout.ep == 1:
        return
    if not arch.is_moe:
        raise ConfigError(f"ep={layout.ep} needs a mixture-of-experts model; {arch.name} is dense (no routed "
                          f"experts): use ep=1")
    ok = ep_choices(arch, layout)
    if arch.n_experts % layout.ep:
        raise ConfigError(f"ep={layout.ep} does not divide {arch.n_experts} experts; use ep in {ok}")
    if layout.ep % layout.cp:
        raise ConfigError(f"ep={layout.ep} is not a multiple of cp={layout.cp} (an expert-parallel group spans "
                          f"the whole cp group); use ep in {ok}")
    if layout.ep_room % layout.ep:
        folded = f"tp x dp_shard x cp = {layout.tp} x " if layout.rank_order == "megatron" else "dp_shard x cp = "
        raise ConfigError(f"ep={layout.ep} does not divide {folded}{layout.dp_shard} x {layout.cp} "
                          f"(ep is carved out of them and adds no GPUs); use ep in {ok}")


def _nearest_dp(layout: Layout, gpus: int) -> str:
    """The nearest layout that fills ``gpus``: change dp if the other degrees divide gpus, else tp=1."""
    rest = layout.tp * layout.pp * layout.cp
    if gpus % rest == 0:
        return replace(layout, dp=gpus // rest).label()
    return replace(layout, dp=gpus, tp=1, pp=1, cp=1).label()


def check_sizes(gpus: object, global_batch: object, seq: object) -> None:
    """Raise ConfigError naming the flag, its value and the fix unless --gpus, --global-batch and --seq
    are whole numbers from 1 to the planner's limits (every prediction and search checks them first)."""
    for flag, value, most, example in (("--gpus", gpus, MAX_GPUS, "--gpus 8 for one 8-GPU node"),
                                       ("--global-batch", global_batch, MAX_BATCH, "--global-batch 256"),
                                       ("--seq", seq, MAX_SEQ, "--seq 4096")):
        if not positive_int(value) or value > most:  # type: ignore[operator]
            raise ConfigError(f"{flag} {value!r}: must be a whole number from 1 to {most:,}; use e.g. {example}")


def check_degrees(layout: Layout) -> None:
    """Raise ConfigError unless every degree and count of ``layout`` is a whole number >= 1."""
    for name in ("dp", "tp", "pp", "cp", "microbatches", "virtual", "dp_replicate"):
        if not positive_int(getattr(layout, name)):
            raise ConfigError(f"layout {name}={getattr(layout, name)!r} must be a whole number >= 1 (1 turns the "
                              f"dimension off)")


def stage_counts(arch: Arch) -> list[int]:
    """The pipeline stage counts (pp x v) that split ``arch``'s layers evenly, up to 64."""
    return [s for s in range(1, min(arch.n_layers, 64) + 1) if arch.n_layers % s == 0]


def fewest_even_chunks(layers: int, pp: int) -> int | None:
    """The fewest model chunks (> 1) per pipeline rank that split ``layers`` evenly over pp x v, as
    Megatron's interleaved schedule needs (92 layers on 4 stages: 23); None if there is none."""
    return next((v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0), None)


def validate(layout: Layout, arch: Arch, gpus: int, global_batch: int, seq: int) -> None:
    """Raise ConfigError if ``layout`` cannot run ``arch`` on ``gpus`` with this batch, or is one that
    meshtrain train (or, for uneven pipeline splits, Megatron) refuses; the message names the nearest
    valid choice. The one home of the layout rules: ``--layout`` and ``--search`` both come here."""
    check_sizes(gpus, global_batch, seq)
    check_degrees(layout)
    if layout.dp % layout.dp_replicate:
        ok = [r for r in range(1, layout.dp + 1) if layout.dp % r == 0]
        raise ConfigError(f"rep={layout.dp_replicate} does not divide dp={layout.dp}; use one of {ok}")
    if layout.world != gpus:
        raise ConfigError(f"layout {layout.label()} uses {layout.world} GPUs, not --gpus {gpus}; nearest "
                          f"that fills them: {_nearest_dp(layout, gpus)}")
    if layout.ac not in AC_MODES:
        raise ConfigError(f"ac={layout.ac!r}: choose one of {', '.join(AC_MODES)}")
    if layout.rank_order not in RANK_ORDERS:
        raise ConfigError(f"order={layout.rank_order!r}: choose one of {', '.join(RANK_ORDERS)}")
    if layout.attn_kernel not in ATTN_KERNELS:
        raise ConfigError(f"attn={layout.attn_kernel!r}: choose one of {', '.join(ATTN_KERNELS)}")
    if layout.attn_kernel == "unfused" and layout.cp > 1:
        raise ConfigError(f"attn=unfused (scores materialised) has no ring attention: it needs cp=1, got "
                          f"cp={layout.cp}; use cp=1 or another attention kernel")
    if layout.p2p_overlap and (layout.pp == 1 or layout.schedule != "interleaved"):
        raise ConfigError(f"ppo=1 (pipeline sends beside the next chunk's compute) is Megatron's overlap of the "
                          f"interleaved schedule: it needs pp > 1 and interleaved, got pp={layout.pp}, "
                          f"{layout.schedule}; use ppo=0")
    if layout.async_tp and not layout.sp:
        raise ConfigError("atp=1 (async TP) overlaps sequence parallelism's all-gathers and reduce-scatters: it "
                          f"needs tp > 1 with sp=1, got tp={layout.tp}, sp={int(layout.sequence_parallel)}; use "
                          "atp=0")
    if layout.async_tp_backward and not (layout.async_tp and layout.tp > 1):
        raise ConfigError("atpb=1 (async TP in the backward too, Transformer Engine's) extends atp=1: it needs tp > 1 "
                          f"with atp=1, got tp={layout.tp}, atp={int(layout.async_tp)}; set atp=1 or use atpb=0")
    if layout.precision not in PRECISIONS:
        raise ConfigError(f"precision={layout.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={layout.zero_stage}: use 0, 1, 2 or 3")
    # meshtrain's own rule (parallel.offload), in the layout's words
    check_offload(layout.offload, layout.zero_stage, key={"offload": "offload", "zero_stage": "zero"}.__getitem__)
    if layout.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={layout.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if not tp_splits(arch, layout.tp):  # meshtrain's check_tensor_parallel: heads, kv heads, MLP split evenly
        ok = [t for t in range(1, arch.n_kv_heads + 1) if tp_splits(arch, t)]
        raise ConfigError(f"tp={layout.tp} does not split {arch.n_heads} heads / {arch.n_kv_heads} kv heads; "
                          f"valid tp: {ok}")
    validate_ep(layout, arch)
    if layout.pp * layout.virtual > arch.n_layers:
        raise ConfigError(f"pp*v = {layout.pp * layout.virtual} stages for {arch.n_layers} layers; use pp*v <= "
                          f"{arch.n_layers}")
    if layout.virtual > 1 and layout.schedule != "interleaved":
        raise ConfigError(f"v={layout.virtual} needs the interleaved schedule (or v=1)")
    stages = layout.pp * layout.virtual
    if stages > 1 and arch.n_layers % stages and not layout.uneven:
        raise ConfigError(f"pp*v = {stages} stages do not split {arch.n_layers} layers evenly, which Megatron "
                          f"refuses; use pp*v in {stage_counts(arch)}, or add uneven=1 to the layout to price "
                          f"torchtitan's / meshtrain train's uneven split (busiest pipeline rank: "
                          f"{-(-arch.n_layers // layout.pp)} layers)")
    if stages > 1 and arch.tie_embeddings:
        raise ConfigError(f"pp*v = {stages}: {arch.name} ties its embedding to the output head, which meshtrain "
                          f"train keeps on one stage; use pp=1 (or a model with tie_embeddings false)")
    if layout.cp > 1 and seq % (2 * layout.cp):  # load-balanced causal ring attention: 2 chunks per rank
        raise ConfigError(f"cp={layout.cp} needs --seq divisible by 2 x cp = {2 * layout.cp} (each cp rank takes "
                          f"two chunks), got --seq {seq}; use --seq {-(-seq // (2 * layout.cp)) * 2 * layout.cp} "
                          f"or a smaller cp")
    if layout.sp and seq % (layout.cp * layout.tp):
        raise ConfigError(f"tp={layout.tp} with sequence parallelism splits each cp rank's sequence over tp: --seq "
                          f"{seq} is not divisible by cp x tp = {layout.cp * layout.tp}; use --seq "
                          f"{-(-seq // (layout.cp * layout.tp)) * layout.cp * layout.tp} or sp=0")
    check_expert_parallel(arch, 1, layout.tp, seq // layout.cp)  # type: ignore[arg-type]  # MoE routes seq/tp
    per_dp = global_batch // layout.dp if global_batch % layout.dp == 0 else 0
    if not per_dp or per_dp % layout.microbatches:
        raise ConfigError(f"--global-batch {global_batch} is not a multiple of dp*m = "
                          f"{layout.dp}*{layout.microbatches}; nearest: --global-batch "
                          f"{max(1, round(global_batch / (layout.dp * layout.microbatches))) * layout.dp * layout.microbatches}")
    if layout.pp > 1 and layout.schedule != "afab" and layout.microbatches < layout.pp:
        raise ConfigError(f"{layout.schedule} needs m >= pp: m={layout.microbatches}, pp={layout.pp}; use m={layout.pp}")
    if layout.schedule == "interleaved" and layout.pp > 1 and layout.microbatches % layout.pp:
        raise ConfigError(f"interleaved needs m a multiple of pp={layout.pp}; use m="
                          f"{-(-layout.microbatches // layout.pp) * layout.pp}")
