"""MosaicML's published MPT throughput (github.com/mosaicml/llm-foundry,
``scripts/train/benchmarking/README.md``): PyTorch FSDP (Composer) on A100s, 8 to 128 GPUs, with the
micro-batch, gradient accumulation, global batch, sharding strategy and activation checkpointing of
each row stated. Rows are chosen by one rule, not by their error: from the two A100 tables, MPT-7B at
2048 tokens on every GPU count (40 GB table), MPT-7B at 8K, 32K and 64K tokens (80 GB table), and every
MPT-70B row of both. The H100 tables are shown but not counted (``LEFT_OUT``, with why)."""

from __future__ import annotations

from .published_run import PublishedRun

README = ("github.com/mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 495218376830); model "
          "shapes scripts/train/yamls/pretrain/mpt-*.yaml (commit 8c8dd48f72168); Composer's FSDP mixed precision "
          "github.com/mosaicml/composer composer/distributed/mosaic_parallelism.py (commit 6405188805a0)")
COMMON = ("FULL_SHARD = zero=3; Activation Checkpointing True = full recomputation of each block (ac=full); m = "
          "GradAccum, micro-batch = MicroBatchSize; attention: llm-foundry's Triton FlashAttention (attn=triton), "
          "the benchmark script's default (scripts/train/benchmarking/submit_benchmarks.py, --attn_impl default "
          "'triton', at commits c6cfb4284 (2023-07) and b2a43a147 (2023-10), which produced the tables); "
          "the loss: llm-foundry's default fused_crossentropy (flash-attn's fused kernel; modeling_mpt.py at "
          "c6cfb4284), priced as a fused loss (closs=1); unstated: the torch / CUDA versions, FSDP prefetch settings; eager (no torch.compile); MPT's biases "
          "and learned positions (0.4% of the parameters) left out")
PURE = ("MP mode PURE: gradients reduce-scattered in bf16 (priced in fp32: meshtrain's rule), weights gathered "
        "in bf16")
MEMORY = ("memory not published, and not comparable: llm-foundry fuses the cross-entropy (its FAQ: a fused kernel "
          "on by default), where the planner prices PyTorch's up-cast loss at 14 bytes a logit; Composer's FSDP1 "
          "flat parameters")
DEFAULT = "MP mode DEFAULT: weights gathered in bf16, gradients reduced in fp32 (Composer's get_mixed_precision)"


def _run(model: str, cluster: str, gpus: int, seq: int, mb: int, accum: int, ac: bool, tps: float, mode: str,
         role: str = "check") -> PublishedRun:
    label = {"a100-40gb": "A100-40GB", "a100": "A100-80GB", "h100": "H100"}[cluster]
    layout = f"dp={gpus}" + (f",m={accum}" if accum > 1 else "") + ",zero=3,attn=triton,closs=1,ac=" + \
        ("full" if ac else "none")
    return PublishedRun(f"MosaicML {model.upper()}, {gpus} {label}, {seq} tokens", model, cluster, gpus, layout,
                        gpus * mb * accum, seq, "tokens_per_s_per_gpu", tps, README, role=role,
                        memory_comparable=False, assumed=f"{COMMON}; {PURE if mode == 'PURE' else DEFAULT}; {MEMORY}")


RUNS: tuple[PublishedRun, ...] = (
    # A100 40GB, 1600 Gbps RoCE: MPT-7B at 2048 tokens on 8 ... 128 GPUs (bf16, PURE, checkpointing)
    _run("mpt-7b", "a100-40gb", 8, 2048, 12, 4, True, 3679, "PURE"),
    _run("mpt-7b", "a100-40gb", 16, 2048, 16, 1, True, 3645, "PURE"),
    _run("mpt-7b", "a100-40gb", 32, 2048, 18, 1, True, 3725, "PURE"),
    _run("mpt-7b", "a100-40gb", 64, 2048, 18, 1, True, 3665, "PURE"),
    _run("mpt-7b", "a100-40gb", 128, 2048, 18, 1, True, 3623, "PURE"),
    # A100 80GB, 1600 Gbps RoCE: MPT-7B at long sequences on 8 GPUs (amp_bf16, DEFAULT)
    _run("mpt-7b", "a100", 8, 8192, 8, 2, True, 3206, "DEFAULT"),
    # fit rows: their implied attention rate was computed before FA1_A100 was chosen (docs/plan.md)
    _run("mpt-7b", "a100", 8, 32768, 2, 2, True, 1672, "DEFAULT", role="fit"),
    _run("mpt-7b", "a100", 8, 65536, 1, 2, True, 1013, "DEFAULT", role="fit"),
    # MPT-70B: every A100 row
    _run("mpt-70b", "a100-40gb", 128, 2048, 4, 1, True, 376, "PURE"),
    _run("mpt-70b", "a100-40gb", 64, 2048, 2, 1, True, 276, "PURE"),
    _run("mpt-70b", "a100", 64, 2048, 8, 4, True, 410, "PURE"),
    _run("mpt-70b", "a100", 32, 2048, 2, 16, True, 373, "PURE"),
)

LEFT_OUT_WHY = ("MosaicML's H100 tables leave their GEMM software unknown: the sweep that produced the 8-GPU rows "
                "(scripts/train/benchmarking/sweep.sh at b2a43a147) passes $IMAGE0 / $IMAGE1, defined nowhere in "
                "the script, for the MPT-7B runs, and the benchmark script's default image (torch 1.13.1, CUDA "
                "11.7) predates Hopper; their MFU at 2048 tokens (36-46%) is below the same models' on their "
                "A100s (50-64%), which no constant of the H100 itself reproduces. The attention is known (Triton "
                "FlashAttention, priced: attn=triton) and the long-sequence row, where it dominates, comes within "
                "10%. Shown, not counted.")
LEFT_OUT: tuple[PublishedRun, ...] = (
    _run("mpt-70b", "h100", 512, 2048, 8, 1, True, 1007, "DEFAULT", role="left out"),
    _run("mpt-13b", "h100", 512, 2048, 16, 1, True, 4952, "DEFAULT", role="left out"),
    _run("mpt-7b", "h100", 512, 2048, 6, 1, False, 9670, "DEFAULT", role="left out"),
    _run("mpt-7b", "h100", 8, 2048, 6, 1, False, 10643, "DEFAULT", role="left out"),
    _run("mpt-7b", "h100", 8, 65536, 1, 2, True, 1956, "DEFAULT", role="left out"),
)
