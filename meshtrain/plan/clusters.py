"""Clusters the planner prices layouts on: GPU presets (datasheet numbers plus one set of
efficiency constants each), a TOML file for any other, and ``this-host`` (calibrated here).

Two link levels: ``intra`` (inside a node: NVLink, or shared memory) and ``inter`` (between nodes:
InfiniBand / RoCE, one NIC per GPU). Each level is an alpha-beta link: ``latency`` seconds per
message and ``bandwidth`` bytes/s per GPU, the *bus bandwidth* nccl-tests reports (for an all-reduce
busbw = algbw * 2(p-1)/p), so a ring all-reduce of n bytes costs n * 2(p-1)/p / bandwidth.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from ..comm.select import CostModel
from ..errors import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class Level:
    """One link level: per-message latency (s) and per-GPU bus bandwidth (bytes/s)."""

    latency: float
    bandwidth: float

    def cost_model(self, gamma: float) -> CostModel:
        """This level as the comm library's alpha-beta-gamma model (gamma: seconds per byte reduced)."""
        return CostModel(self.latency, 1.0 / self.bandwidth, gamma, source="plan")


@dataclass(frozen=True)
class Cluster:
    """Hardware of one cluster and the efficiencies the roofline applies to it."""

    name: str
    gpus_per_node: int
    memory_bytes: float
    """Device memory of one GPU (bytes)."""
    peak_flops: float
    """Dense bf16 matmul peak of one GPU (FLOP/s); MFU is reported against it."""
    fp32_flops: float
    """Dense fp32 matmul peak (FLOP/s): meshtrain's "fp32" precision runs matmuls in fp32."""
    hbm_bandwidth: float
    """Device memory bandwidth (bytes/s): the roof of element-wise ops."""
    intra: Level
    inter: Level
    matmul_efficiency: float = 0.7
    """Fraction of peak that large matmuls reach."""
    attention_efficiency: float = 0.5
    """Fraction of ``peak_flops`` torch's flash attention (FlashAttention-2) reaches in its forward on
    long (16K) causal sequences; shorter ones are slower by the kernel's measured length curve
    (``compute.attention_rate``)."""
    attention_bwd_efficiency: float = 0.5
    """The same for its backward (FLOPs counted as 2.5x the forward's)."""
    fused_attention_speedup: float = 1.0
    """How much faster cuDNN's fused attention (Transformer Engine, Megatron: ``attn=cudnn``) runs than
    FlashAttention-2 on this GPU (1.0: no measurement, taken as equal)."""
    fa1_attention_efficiency: float = 0.0
    """Fraction of ``peak_flops`` a FlashAttention-1-class kernel (``attn=triton``: llm-foundry's Triton
    FlashAttention, MosaicML's runs) reaches on long causal sequences, forward and backward alike, shorter
    ones slower by the same length curve; 0: no measurement, priced at half FlashAttention-2's
    (``FA2_OVER_FA1``)."""
    hbm_efficiency: float = 0.7
    """Fraction of hbm_bandwidth that element-wise kernels reach."""
    fp8_speedup: float = 1.0
    """Speed-up of the linear layers' matmuls under float8 (1.0: the GPU has no fp8)."""
    gemm_k0: float = 0.0
    """A GEMM's fixed cost per output tile in reduction-dimension elements, at fp8: a GEMM whose
    reduction dimension is K runs at K / (K + k0) of the long-K rate (bf16: k0 / fp8_speedup, the
    main loop being that much slower per K). Applied to the grouped expert GEMMs only (``moe.py``);
    0: not modelled. Hopper: 720, fitted to DeepGEMM's published H800 FP8 table (README, 2025-02-25:
    4096-row GEMMs at K = 512, 1536, 2048, 7168, 16384 reach 590, 990, 1025-1099, 1288-1304, 1358
    TFLOPS), nothing else."""
    sm_count: int = 0
    """Streaming multiprocessors of one GPU (0: not a GPU, or unknown): what a communication kernel
    that holds some of them while compute runs beside it leaves to that compute (``moe.ep_exposed``)."""
    eager_elementwise_passes: float = 1.0
    """A scale on the bytes eager element-wise kernels are counted to move (``compute.ELEMENTWISE``:
    each op class's eager kernels, counted from the code); 1.0 for every preset."""
    reserved_bytes: float = 2 * GiB
    """Memory not available to tensors: CUDA context, allocator fragmentation, NCCL buffers."""
    backend: str = "nccl"
    """"nccl" (auto takes NCCL's native collectives) or "host" (meshtrain's own algorithms)."""
    memory_shared: bool = False
    """True for a CPU host: the ranks share memory_bytes and its cores (peak_flops is the host's)."""
    cores: int = 0
    """CPU cores of a host (0 for GPUs)."""
    reduce_gamma: float = 0.0
    """Seconds per byte reduced on top of moving it: 0 for NCCL, whose kernels reduce in the same pass
    that moves the data (nccl-tests' bus bandwidth already includes it); the cost model's gamma on a host."""
    profile_compute: bool = False
    """Time blocks, the head and the optimizer on this machine (``profile.py``) instead of the roofline:
    only ``this-host`` can, and there the roofline misses the framework's per-op overhead."""
    base_memory_bytes: float = 0.0
    """Bytes every rank holds before training starts: on a host the interpreter, torch and meshtrain
    (counted in the resident set); 0 on GPUs, whose allocator counts only tensors."""
    pcie_bandwidth: float = 0.0
    """Host <-> GPU bytes/s per GPU and direction, pinned memory (ZeRO CPU offload's copies); 0 for a
    host, whose "device" is its own memory."""
    host_adam_rate: float = 0.0
    """Parameters/s a node's CPUs update with a fused AdamW step (ZeRO CPU offload), shared by the
    node's ranks: a memory-bound pass of 28 bytes per parameter (``offload.py``)."""
    host_memory_bytes: float = 0.0
    """A node's host memory, shared by its ranks: where offloaded masters and AdamW state live (0: unknown,
    not checked)."""
    notes: str = ""

    def ranks_per_node(self, world: int) -> int:
        """Ranks of a ``world``-rank layout that share one node's host (CPUs, memory, PCIe root)."""
        return max(1, min(world, self.gpus_per_node))

    def per_rank_peak(self, world: int, precision: str) -> float:
        """Matmul peak one rank gets (FLOP/s) at ``precision``; on a host the ranks split the cores
        (meshtrain's launcher gives each of ``world`` local ranks cores / world intra-op threads)."""
        peak = self.fp32_flops if precision == "fp32" else self.peak_flops
        return peak / max(world, 1) if self.memory_shared else peak

    def per_rank_bandwidth(self, world: int) -> float:
        """Bytes/s one rank's element-wise kernels move (``hbm_efficiency`` of the memory bandwidth;
        on a host the ranks split it, as they split the cores)."""
        rate = self.hbm_bandwidth * self.hbm_efficiency
        return rate / max(world, 1) if self.memory_shared else rate

    def memory_per_rank(self, world: int) -> float:
        """Bytes one rank may use (a host's memory is shared by the ranks on it)."""
        if self.memory_shared:
            return (self.memory_bytes - self.reserved_bytes) / max(world, 1)
        return self.memory_bytes - self.reserved_bytes


def _gpu(name: str, **kw) -> Cluster:
    return Cluster(name=name, **kw)


HOST_STREAM_EFFICIENCY = 0.7
"""Fraction of a host's theoretical DRAM bandwidth a fused CPU AdamW step moves (a STREAM-like
share: the step is memory-bound; on this machine's core it moved 42 GB/s, more than an eager
``torch.add``'s 35 GB/s)."""


def host_adam_rate(dram_bandwidth: float) -> float:
    """Parameters/s a node's fused CPU AdamW updates: ``HOST_STREAM_EFFICIENCY`` of its DRAM
    bandwidth over the 28 bytes each parameter moves (read weight, gradient and two moments;
    write weight and moments, fp32)."""
    return HOST_STREAM_EFFICIENCY * dram_bandwidth / 28


HOST_DDR5 = {"pcie_bandwidth": 50e9, "host_adam_rate": host_adam_rate(614e9), "host_memory_bytes": 2e12}
"""The host side of the Hopper presets: a DGX H100/H200 (see the h100 preset's comment)."""


ATTN_FA2_FWD = 335e12 / 989e12
"""FlashAttention-2's forward on an H100 SXM5 (700 W), 16K causal tokens, head dim 128, as a fraction of
the bf16 peak: 335 TFLOP/s (FlashAttention-3 paper, arXiv 2407.08608, its H100 forward figure)."""
ATTN_FA2_BWD = 322e12 / 989e12
"""Its backward: 322 TFLOP/s (the same paper's backward figure, 16K tokens)."""
CUDNN_OVER_FA2 = 1.6
"""cuDNN's fused attention over FlashAttention-2 on the same H100: 539/335 forward, 516/322 backward."""
FA1_A100 = 0.40
"""FlashAttention(-1) on an A100, long sequences: the FlashAttention-2 paper (Dao, arXiv 2307.08691,
abstract) puts FlashAttention at "only 25-40% of the theoretical maximum FLOPs/s" of the A100 and
FlashAttention-2 at 50-73 %; the top of the range is the long-sequence end (the length curve gives the
short end: 0.40 x 191/335 = 0.23 at 512 tokens). llm-foundry's Triton FlashAttention is the same
algorithm: "Overall Triton forward + backward is slightly slower than CUDA forward + backward"
(``llmfoundry/models/layers/flash_attn_triton.py``, copied from HazyResearch/flash-attention)."""
FA2_OVER_FA1 = 2.0
"""FlashAttention-2 "is around 2x faster than FlashAttention" (the same paper, section 4.1): the ratio
a GPU without a FlashAttention-1 measurement prices ``attn=triton`` at."""
H100_MATMUL = 0.70
"""Large bf16 matmuls on a 700 W H100 SXM5, as a fraction of peak (set once, before any prediction)."""
GT500_MATMUL = 0.55
"""The same on torchtitan's Grand Teton H100 at its 500 W power limit (HBM2e): set with torchtitan's
published 8B MFUs in mind (the rows marked fit in ``published_torchtitan``)."""
GT500_CLOCK = GT500_MATMUL / H100_MATMUL
"""A 500 W cap lowers the sustained clock of every tensor-core kernel alike: the Grand Teton's attention
rates are the 700 W ones scaled by the ratio of the two matmul efficiencies."""

PRESETS: dict[str, Cluster] = {
    # Attention (all Hopper presets): FlashAttention-2's and cuDNN's measured rates on an H100 SXM5 at
    # 700 W, head dim 128, 16K causal tokens (Shah et al., FlashAttention-3, arXiv 2407.08608, the
    # figures "Attention forward/backward speed, head dim 128 (H100 80GB SXM5)"): FA2 335 TFLOP/s
    # forward, 322 backward; cuDNN 539 and 516, i.e. 1.6x. As fractions of the 989 TFLOP/s peak:
    # ATTN_FA2_FWD / ATTN_FA2_BWD below.
    # SMs: 132 on the H100 and H200 SXM, 108 on the A100 (NVIDIA's datasheets / architecture papers).
    # H100 SXM5 80 GB, 700 W: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32), 3.35 TB/s HBM3;
    # NVLink 4 (450 GB/s per direction; nccl-tests all-reduce busbw ~360 GB/s on 8 GPUs) and one
    # 400 Gb/s InfiniBand NIC per GPU (50 GB/s, ~45 GB/s achieved).
    # Host side (ZeRO CPU offload), a DGX H100: PCIe Gen5 x16 per GPU, 63 GB/s per direction in
    # theory (32 GT/s x 16 lanes x 128/130), ~50 GB/s for pinned copies (the ~80% PCIe Gen4 x16
    # reaches, ~25 of 31.5 GB/s); two Xeon 8480C with 16 channels of DDR5-4800 (614 GB/s), 2 TB.
    "h100": _gpu("h100", gpus_per_node=8, memory_bytes=80 * GiB, peak_flops=989e12, fp32_flops=67e12,
                 hbm_bandwidth=3.35e12, intra=Level(10e-6, 360e9), inter=Level(20e-6, 45e9),
                 matmul_efficiency=H100_MATMUL, attention_efficiency=ATTN_FA2_FWD,
                 attention_bwd_efficiency=ATTN_FA2_BWD, fused_attention_speedup=CUDNN_OVER_FA2, fp8_speedup=1.6,
                 gemm_k0=720, sm_count=132, **HOST_DDR5, notes="H100 SXM5 80GB, NVLink 4 + 400G InfiniBand per GPU"),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s.
    "h200": _gpu("h200", gpus_per_node=8, memory_bytes=141e9, peak_flops=989e12, fp32_flops=67e12,
                 hbm_bandwidth=4.8e12, intra=Level(10e-6, 360e9), inter=Level(20e-6, 45e9),
                 matmul_efficiency=H100_MATMUL, attention_efficiency=ATTN_FA2_FWD,
                 attention_bwd_efficiency=ATTN_FA2_BWD, fused_attention_speedup=CUDNN_OVER_FA2, fp8_speedup=1.6,
                 gemm_k0=720, sm_count=132, **HOST_DDR5, notes="H200 SXM 141GB, NVLink 4 + 400G InfiniBand per GPU"),
    # A100 SXM4 80 GB: 312 TFLOP/s bf16, 19.5 fp32, 2.0 TB/s; NVLink 3 (~230 GB/s busbw) and one
    # 200 Gb/s HDR NIC per GPU (~22.5 GB/s achieved). No fp8. Host (DGX A100 640GB): PCIe Gen4 x16
    # (31.5 GB/s per direction, ~25 GB/s pinned), two EPYC 7742 with 16 channels of DDR4-3200
    # (410 GB/s), 2 TB.
    "a100": _gpu("a100", gpus_per_node=8, memory_bytes=80 * GiB, peak_flops=312e12, fp32_flops=19.5e12,
                 hbm_bandwidth=2.0e12, intra=Level(10e-6, 230e9), inter=Level(20e-6, 22.5e9),
                 matmul_efficiency=0.70, attention_efficiency=0.5, attention_bwd_efficiency=0.5,
                 fa1_attention_efficiency=FA1_A100, fp8_speedup=1.0, sm_count=108,
                 pcie_bandwidth=25e9, host_adam_rate=host_adam_rate(410e9), host_memory_bytes=2e12,
                 notes="A100 SXM4 80GB, NVLink 3 + 200G InfiniBand per GPU"),
    # A100 SXM4 40 GB: the 80 GB part's compute and links with 40 GiB of HBM2 at 1.555 TB/s (the 40 GB
    # datasheet); host as a DGX A100 320GB's (1 TB). MosaicML's A100 tables ran 8 of them a node with
    # "1600 Gbps node-node interconnect (RoCE)": 8 x 200 Gb/s, one NIC per GPU, as the a100 preset.
    "a100-40gb": _gpu("a100-40gb", gpus_per_node=8, memory_bytes=40 * GiB, peak_flops=312e12, fp32_flops=19.5e12,
                      hbm_bandwidth=1.555e12, intra=Level(10e-6, 230e9), inter=Level(20e-6, 22.5e9),
                      matmul_efficiency=0.70, attention_efficiency=0.5, attention_bwd_efficiency=0.5,
                      fa1_attention_efficiency=FA1_A100,
                      fp8_speedup=1.0, sm_count=108, pcie_bandwidth=25e9, host_adam_rate=host_adam_rate(410e9),
                      host_memory_bytes=1e12, notes="A100 SXM4 40GB, NVLink 3 + 200G per GPU"),
    # The hosts of torchtitan's published runs (Meta's Grand Teton): H100 with 96 GB of HBM2e at
    # 2.4 TB/s, run at the default 500 W power limit (lower sustained clocks than the 700 W h100),
    # 400 Gb/s RDMA per GPU.
    "h100-gt500": _gpu("h100-gt500", gpus_per_node=8, memory_bytes=96 * GiB, peak_flops=989e12,
                       fp32_flops=67e12, hbm_bandwidth=2.4e12, intra=Level(10e-6, 360e9),
                       inter=Level(20e-6, 45e9), matmul_efficiency=GT500_MATMUL,
                       attention_efficiency=ATTN_FA2_FWD * GT500_CLOCK,
                       attention_bwd_efficiency=ATTN_FA2_BWD * GT500_CLOCK,
                       fused_attention_speedup=CUDNN_OVER_FA2, fp8_speedup=1.6, gemm_k0=720, sm_count=132,
                       **HOST_DDR5,  # (its host taken as a DGX H100's)
                       notes="Grand Teton H100 96GB HBM2e at 500 W"),
}


def known_clusters() -> list[str]:
    """Every cluster name ``resolve_cluster`` accepts besides a TOML path."""
    return sorted(PRESETS) + ["this-host"]


@dataclass(frozen=True)
class _Rule:
    """What one Cluster field accepts: its type, its range, and an example for the message."""

    kind: type
    above: float | None = None
    """Exclusive lower bound."""
    least: float | None = None
    """Inclusive lower bound."""
    most: float | None = None
    """Inclusive upper bound."""
    example: str = ""
    choices: tuple[str, ...] = ()

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not accepted (None if it is)."""
        if self.kind is bool or self.kind is str:
            if type(value) is not self.kind:
                return "must be " + ("true or false" if self.kind is bool else "a string")
            return f"must be one of {', '.join(self.choices)}" if self.choices and value not in self.choices \
                else None
        whole = isinstance(value, int) and not isinstance(value, bool)
        if self.kind is int and not whole:
            return "must be a whole number"
        if not whole and not isinstance(value, float):
            return "must be a number"
        if not math.isfinite(value):  # type: ignore[arg-type]
            return "must be finite"
        if self.above is not None and not value > self.above:  # type: ignore[operator]
            return f"must be > {self.above:g}"
        if self.least is not None and not value >= self.least:  # type: ignore[operator]
            return f"must be >= {self.least:g}"
        if self.most is not None and not value <= self.most:  # type: ignore[operator]
            return f"must be <= {self.most:g}"
        return None


_SHARE = {"above": 0.0, "most": 1.0}
RULES: dict[str, _Rule] = {
    "name": _Rule(str, example='"my-cluster"'),
    "gpus_per_node": _Rule(int, least=1, example="8"),
    "memory_bytes": _Rule(float, above=0, example="85899345920 (80 GiB)"),
    "peak_flops": _Rule(float, above=0, example="989e12 (FLOP/s, dense bf16)"),
    "fp32_flops": _Rule(float, above=0, example="67e12"),
    "hbm_bandwidth": _Rule(float, above=0, example="3.35e12 (bytes/s)"),
    "matmul_efficiency": _Rule(float, **_SHARE, example="0.7 (a fraction of peak_flops)"),
    "attention_efficiency": _Rule(float, **_SHARE, example="0.34"),
    "attention_bwd_efficiency": _Rule(float, **_SHARE, example="0.33"),
    "fused_attention_speedup": _Rule(float, least=1, example="1.6 (1.0: no measurement)"),
    "fa1_attention_efficiency": _Rule(float, least=0, most=1, example="0.4 (0: half of FlashAttention-2's)"),
    "hbm_efficiency": _Rule(float, **_SHARE, example="0.7"),
    "fp8_speedup": _Rule(float, least=1, example="1.6 (1.0: no fp8)"),
    "gemm_k0": _Rule(float, least=0, example="720 (0: not modelled)"),
    "sm_count": _Rule(int, least=0, example="132 (H100 SXM; 0: unknown)"),
    "eager_elementwise_passes": _Rule(float, least=1, example="1.0"),
    "reserved_bytes": _Rule(float, least=0, example="2147483648 (2 GiB)"),
    "backend": _Rule(str, choices=("nccl", "host"), example='"nccl"'),
    "memory_shared": _Rule(bool, example="false"),
    "cores": _Rule(int, least=0, example="0 (GPUs)"),
    "reduce_gamma": _Rule(float, least=0, example="0.0"),
    "profile_compute": _Rule(bool, example="false"),
    "base_memory_bytes": _Rule(float, least=0, example="0.0"),
    "pcie_bandwidth": _Rule(float, least=0, example="50e9 (0: unknown)"),
    "host_adam_rate": _Rule(float, least=0, example="1.5e10 (0: unknown)"),
    "host_memory_bytes": _Rule(float, least=0, example="2e12 (0: not checked)"),
    "notes": _Rule(str, example='""'),
}
"""Every scalar Cluster field's type and range (``intra`` and ``inter`` are ``LEVEL_RULES`` tables)."""
LEVEL_RULES = {"latency": _Rule(float, least=0, example="2e-05 (seconds per message)"),
               "bandwidth": _Rule(float, above=0, example="45e9 (bytes/s per GPU, nccl-tests busbw)")}


def _level(raw: object, where: str) -> Level:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table with latency (s) and bandwidth (bytes/s), got {raw!r}; "
                          f"write e.g. [inter] latency = 2e-05 bandwidth = 45e9 on their own lines")
    unknown = sorted(set(raw) - set(LEVEL_RULES))
    missing = sorted(set(LEVEL_RULES) - set(raw))
    if unknown or missing:
        raise ConfigError(f"{where}: {'unknown keys ' + str(unknown) if unknown else 'missing ' + str(missing)}; "
                          f"a link level has exactly latency (s) and bandwidth (bytes/s)")
    for key, rule in LEVEL_RULES.items():
        why = rule.problem(raw[key])
        if why:
            raise ConfigError(f"{where} {key} = {raw[key]!r} {why}; use e.g. {key} = {rule.example}")
    return Level(float(raw["latency"]), float(raw["bandwidth"]))


def check_cluster(cluster: Cluster, where: str) -> None:
    """Raise ConfigError naming the field, its value and the fix unless every field of ``cluster`` has
    its type and range (``RULES``) and the memory left after ``reserved_bytes`` is positive."""
    for f in fields(Cluster):
        value = getattr(cluster, f.name)
        if f.name in ("intra", "inter"):
            if not isinstance(value, Level):
                raise ConfigError(f"{where} [{f.name}]: must be a table with latency and bandwidth")
            _level({"latency": value.latency, "bandwidth": value.bandwidth}, f"{where} [{f.name}]")
            continue
        why = RULES[f.name].problem(value)
        if why:
            raise ConfigError(f"{where}: {f.name} = {value!r} {why}; use e.g. {f.name} = {RULES[f.name].example}")
    if cluster.reserved_bytes >= cluster.memory_bytes:
        raise ConfigError(f"{where}: reserved_bytes = {cluster.reserved_bytes:g} leaves nothing of memory_bytes = "
                          f"{cluster.memory_bytes:g} for tensors; reserved_bytes is what the CUDA context and "
                          f"allocator keep (about 2 GiB): use a smaller one")


def load_toml(path: Path) -> Cluster:
    """A cluster from a TOML file: top-level Cluster fields, ``[intra]`` and ``[inter]`` tables with
    ``latency`` and ``bandwidth``; an optional ``base = "h100"`` (a preset) fills the fields not given.
    Every field is checked (``check_cluster``): ConfigError names the field, the value and the fix."""
    where = f"--cluster {path}"
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{where}: cannot read TOML ({e}); give a readable TOML file or a preset "
                          f"({', '.join(known_clusters())})") from e
    base_name = raw.pop("base", None)
    allowed = {f.name for f in fields(Cluster)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; use {sorted(allowed)}")
    for lvl in ("intra", "inter"):
        if lvl in raw:
            raw[lvl] = _level(raw[lvl], f"{where} [{lvl}]")
    if raw.get("profile_compute") is True:
        raise ConfigError(f"{where}: profile_compute = true times blocks on this machine, which only "
                          f"--cluster this-host prices; remove it")
    raw.setdefault("name", path.stem)
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in known_clusters():
            raise ConfigError(f"{where}: base = {base_name!r} is not a preset; use one of "
                              f"{', '.join(known_clusters())}")
        cluster = replace(resolve_cluster(base_name), **raw)
    else:
        missing = sorted(f.name for f in fields(Cluster) if f.name not in raw and f.default is MISSING)
        if missing:
            raise ConfigError(f"{where}: missing {missing} (or set base = \"h100\" to start from a preset)")
        cluster = Cluster(**raw)
    check_cluster(cluster, where)
    return cluster


def check_whole_nodes(cluster: Cluster, gpus: int, allow_partial: bool = False) -> str | None:
    """Refuse ``gpus`` that is more than one node but not a whole number of nodes: launchers start the
    same number of ranks on every node (torchrun --nproc-per-node), and the planner's pricing packs
    ranks into full nodes. With ``allow_partial`` return a warning line instead (None when whole)."""
    per = cluster.gpus_per_node
    if cluster.memory_shared or gpus <= per or gpus % per == 0:
        return None
    lo, hi = gpus // per * per, -(-gpus // per) * per
    if not allow_partial:
        raise ConfigError(f"--gpus {gpus} is {gpus / per:g} nodes of {per} GPUs ({cluster.name}): a launcher starts "
                          f"the same number of ranks on every node; use --gpus {lo} or {hi} (whole nodes), a "
                          f"cluster TOML with base = \"{cluster.name}\" and the gpus_per_node your nodes run, or "
                          f"--allow-partial-node to price {gpus} ranks packed onto {hi // per} nodes anyway")
    return (f"warning: --gpus {gpus} leaves the last of {hi // per} nodes with {gpus - lo} of its {per} GPUs "
            f"(--allow-partial-node): priced as packed, which no uniform launcher starts")


def tp_warning(cluster: Cluster, tp: int) -> str | None:
    """A warning line if tensor-parallel groups of ``tp`` ranks cross nodes (legal, but each block's
    collectives then run on the inter-node links, ``inter`` instead of ``intra``); None otherwise."""
    per = cluster.gpus_per_node
    if tp <= 1 or per % tp == 0:
        return None
    if tp > per:
        return (f"warning: tp={tp} spans {-(-tp // per)} nodes of {per} GPUs: its per-block collectives run at "
                f"the inter-node {cluster.inter.bandwidth / 1e9:g} GB/s, not {cluster.intra.bandwidth / 1e9:g} "
                f"GB/s (priced so); tp <= {per} keeps them inside a node")
    return (f"warning: tp={tp} does not divide the {per} GPUs of a node, so some tp groups straddle two nodes; "
            f"the planner prices them as inside one (optimistic); use a tp that divides {per}")


def resolve_cluster(spec: str) -> Cluster:
    """A cluster by preset name, ``this-host``, or a TOML file; ConfigError names the nearest preset."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "this-host":
        from .host import this_host  # measures this machine (imports torch)

        return this_host()
    path = Path(spec)
    if spec.endswith(".toml") or path.is_file():
        return load_toml(path)
    near = difflib.get_close_matches(spec, known_clusters(), n=1, cutoff=0.0)
    raise ConfigError(f"--cluster {spec!r} is not a known cluster or a TOML file; nearest: {near[0]!r} "
                      f"(known: {', '.join(known_clusters())})")
