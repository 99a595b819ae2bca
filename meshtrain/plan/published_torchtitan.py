"""torchtitan's published runs (github.com/pytorch/torchtitan, ``benchmarks/``): Llama 3.1 8B, 70B and
405B on Grand Teton H100s (96 GB HBM2e, 500 W: the ``h100-gt500`` preset) from 8 to 512 GPUs, and 8B on
H200s. Layouts, batches, sequence lengths and memory are the files'; the rest is listed per row."""

from __future__ import annotations

from .published_run import PublishedRun

REPO = "github.com/pytorch/torchtitan"
DEC24 = (f"{REPO} benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e20d11; torchtitan 9dec370, torch "
         f"1963fc8, 2024-12); the same tables as Liang et al., TorchTitan, arXiv 2410.06511")
ASYNC_TP = f"{REPO} benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (commit 2887250bbd94)"
H200 = (f"{REPO} benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (commit 4a61bd87d3c7; torchtitan "
        f"e7c0cae, its torchtitan/models/llama3/train_configs/llama3_8b.toml)")
SAC = ("'selective AC' is the 8B toml's selective_ac_option = 'op' (train_configs/llama3_8b.toml at 9dec370): "
       "torchtitan's op policy, which saves every matmul output but every second one of a block (ac=op)")
SEQ = "seq 8192: the model's train_configs toml at 9dec370 (the table does not say)"
CP = ("K/V exchanged by all-gather: torchtitan's --experimental.context_parallel_rotate_method defaults to "
      "'allgather' (config_manager.py at 9dec370), cpag=1; load-balanced causal sharding (PyTorch's default)")
PP = ("micro-batches = stages (torchtitan's default then: m=8 1F1B, 16 interleaved v=2); 126 layers split "
      "unevenly (uneven=1); FSDP2 under the pipeline keeps the stage's unsharded weights and gradients "
      "across micro-batches (fsdp=1)")
FP8 = "Float8 = torchao tensorwise dynamic scaling (the default recipe then)"


LOSS = ("the loss compiled (closs=1): --training.compile compiles the cross-entropy at e7c0cae "
        "(torchtitan/components/loss.py, build_cross_entropy_loss); at 9dec370 that line is commented out "
        "(train.py: 'compiling loss function causes CUDA errors'), so the Dec 2024 rows keep the eager loss")
KVREP = ("K/V repeated to every query head before SDPA (kvrep=1: repeat_kv in torchtitan/models/llama/model.py at "
         "9dec370, llama3/model.py at e7c0cae)")


def _run(name: str, model: str, gpus: int, layout: str, batch: int, seq: int, value: float, source: str,
         memory: float | None = None, role: str = "check", cluster: str = "h100-gt500", assumed: str = "",
         compile: bool = True) -> PublishedRun:
    return PublishedRun(name, model, cluster, gpus, layout + ",kvrep=1", batch, seq, "tokens_per_s_per_gpu", value,
                        source, role=role, compile=compile, memory_gib=memory, assumed=f"{assumed}; {KVREP}")


RUNS: tuple[PublishedRun, ...] = (
    # Table 1: 8B, 8 GPUs, FSDP, local batch 2 (global 16), selective AC. The fit rows: GT500_MATMUL
    # was set with the README's "33% to 39% MFU (with or without torch.compile)" for these runs in view.
    _run("torchtitan 8B FSDP 8 GPUs, eager (T1)", "llama3-8b", 8, "dp=8,zero=3,ac=op", 16, 8192, 5762, DEC24, 82.4,
         role="fit", compile=False, assumed=f"{SAC}; {SEQ}"),
    _run("torchtitan 8B FSDP 8 GPUs, compile (T1)", "llama3-8b", 8, "dp=8,zero=3,ac=op", 16, 8192, 6667, DEC24, 77.0,
         role="fit", assumed=f"{SAC}; {SEQ}"),
    _run("torchtitan 8B FSDP 8 GPUs, compile + Float8 (T1)", "llama3-8b", 8, "dp=8,zero=3,ac=op,precision=fp8", 16,
         8192, 8532, DEC24, 76.8, assumed=f"{SAC}; {SEQ}; {FP8}"),
    # Table 3: 8B, 128 GPUs, local batch 2 (global 256)
    _run("torchtitan 8B FSDP 128 GPUs, eager (T3)", "llama3-8b", 128, "dp=128,zero=3,ac=op", 256, 8192, 5605, DEC24,
         67.0, role="fit", compile=False, assumed=f"{SAC}; {SEQ}"),
    _run("torchtitan 8B FSDP 128 GPUs, compile (T3)", "llama3-8b", 128, "dp=128,zero=3,ac=op", 256, 8192, 6514,
         DEC24, 62.0, role="fit", assumed=f"{SAC}; {SEQ}"),
    _run("torchtitan 8B FSDP 128 GPUs, compile + Float8 (T3)", "llama3-8b", 128, "dp=128,zero=3,ac=op,precision=fp8",
         256, 8192, 8380, DEC24, 61.8, assumed=f"{SAC}; {SEQ}; {FP8}"),
    # Table 2: 8B, 8 GPUs, FSDP x CP, compile + Float8, local batch 1, full AC
    *(_run(f"torchtitan 8B FSDP {8 // cp} x CP {cp}, {seq // 1024}K tokens (T2)", "llama3-8b", 8,
           f"dp={8 // cp},cp={cp},zero=3,ac=full,precision=fp8" + (",cpag=1" if cp > 1 else ""), 8 // cp, seq, tps,
           DEC24, mem, assumed=f"global batch = FSDP degree x local batch 1; {CP}; {FP8}")
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))),
    # Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, compile + Float8, local batch 16 (global 512), full AC
    _run("torchtitan 70B FSDP 32 x TP 8 (T4)", "llama3-70b", 256, "dp=32,tp=8,zero=3,ac=full,precision=fp8", 512,
         8192, 829, DEC24, 71.9, assumed=f"{SEQ}; {FP8}"),
    _run("torchtitan 70B FSDP 32 x TP 8, async TP (T4)", "llama3-70b", 256,
         "dp=32,tp=8,zero=3,ac=full,precision=fp8,atp=1", 512, 8192, 876, DEC24, 67.6, assumed=f"{SEQ}; {FP8}"),
    # Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, compile + Float8 + async TP, local batch 32 (global 256)
    _run("torchtitan 405B FSDP 8 x TP 8 x PP 8, 1F1B (T5)", "llama3-405b", 512,
         "dp=8,tp=8,pp=8,m=8,1f1b,uneven=1,fsdp=1,zero=3,ac=full,precision=fp8,atp=1", 256, 8192, 100, DEC24, 82.5,
         assumed=f"{SEQ}; {PP}; {FP8}"),
    _run("torchtitan 405B FSDP 8 x TP 8 x PP 8, interleaved (T5)", "llama3-405b", 512,
         "dp=8,tp=8,pp=8,m=16,v=2,interleaved,uneven=1,fsdp=1,zero=3,ac=full,precision=fp8,atp=1", 256, 8192, 128,
         DEC24, 72.7, assumed=f"{SEQ}; {PP}; {FP8}"),
    # Table 6: 405B, 512 GPUs, TP 8 x PP 8 x FSDP x CP, 1F1B, local batch 8, full AC
    *(_run(f"torchtitan 405B FSDP {8 // cp} x CP {cp} x TP 8 x PP 8, {seq // 1024}K tokens (T6)", "llama3-405b",
           512, f"dp={8 // cp},cp={cp},tp=8,pp=8,m=8,1f1b,uneven=1,fsdp=1,zero=3,ac=full,precision=fp8,atp=1"
           + (",cpag=1" if cp > 1 else ""), 8 * (8 // cp), seq, tps, DEC24, mem,
           assumed=f"global batch = FSDP degree x local batch 8; {PP}; {CP}; {FP8}")
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))),
    # async TP benchmark (June 2025): vanilla and async TP, bf16 and float8 tensorwise. The float8
    # rowwise rows are left out: the file itself says their vanilla baseline is a known slow path
    # (torchtitan issue 1207), and the planner prices tensorwise scaling only.
    *(_run(f"torchtitan 70B FSDP 32 x TP 8, {q}{', async TP' if atp else ''} (async TP table)", "llama3-70b", 256,
           f"dp=32,tp=8,zero=3,ac=full,precision={p}" + (",atp=1" if atp else ""), 512, 8192, tps, ASYNC_TP,
           assumed=f"{SEQ}; global batch = 32 x local batch 16; tokens/sec read as per GPU (the 2D rows match "
                   f"Table 4's per-GPU 829); {FP8}")
      for q, p, atp, tps in (("bf16", "bf16", 0, 597.3), ("bf16", "bf16", 1, 652.4),
                             ("float8 tensorwise", "fp8", 0, 809.8), ("float8 tensorwise", "fp8", 1, 942.4))),
    *(_run(f"torchtitan 8B FSDP 8 x TP 8, {q}{', async TP' if atp else ''} (async TP table)", "llama3-8b", 64,
           f"dp=8,tp=8,zero=3,ac=op,precision={p}" + (",atp=1" if atp else ""), 96, 8192, tps, ASYNC_TP,
           assumed=f"{SEQ}; 'per op SAC' = ac=op; global batch = 8 x local batch 12; tokens/sec read as per GPU; "
                   f"{FP8}")
      for q, p, atp, tps in (("bf16", "bf16", 0, 4378), ("bf16", "bf16", 1, 4809.4),
                             ("float8 tensorwise", "fp8", 0, 5078.1), ("float8 tensorwise", "fp8", 1, 5570.1))),
    # H200 (Trainy on WhiteFiber, June 2025): 8B, FSDP over 4 and 8 nodes, local batch 2, compile + float8
    *(_run(f"torchtitan 8B FSDP {g} H200 (Trainy)", "llama3-8b", g, f"dp={g},zero=3,ac=op,precision=fp8,closs=1",
           2 * g, 8192, tps, H200, mem, cluster="h200",
           assumed=f"seq 8192 and selective op AC from llama3_8b.toml at e7c0cae; float8 with FSDP float8 "
                   f"all-gather (priced as bf16 gathers: not modelled); 400 Gb/s CX-7 per GPU as the h200 preset; "
                   f"{LOSS}")
      for g, tps, mem in ((32, 10938, 47.96), (64, 10753, 46.97))),
)
