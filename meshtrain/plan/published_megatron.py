"""Megatron-LM's and Megatron-Bridge's published runs on H100: GPT-3 177B strong scaling (Megatron-LM
README) and the mixtures of experts Qwen3-30B-A3B and DeepSeek-V3 (Megatron-Bridge's 25.09 performance
summary). Sources and what each leaves unstated are in the constants below and in docs/plan.md."""

from __future__ import annotations

from .published_run import PublishedRun

MEGATRON = ("Megatron-LM README (github.com/NVIDIA/Megatron-LM): 'Strong Scaling Results' and its figure "
            "images/strong_scaling.png, the model table images/model_table.png and its 'Benchmark Configuration'; "
            "method: Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
            "Megatron-LM, arXiv 2104.04473")
MEGATRON_ASSUMED = ("tp=8, pp=6 from the README's model table for 177B (dp = GPUs / 48; its 2,304-GPU row, 997 "
                    "PFLOP/s, is a point of the strong-scaling figure), seq 4096 from its benchmark configuration; "
                    "interleaved: the benchmark configuration lists PP communication overlap, which Megatron's "
                    "arguments.py switches off unless the interleaved schedule is on, so the runs interleaved; "
                    "v not given, so the least interleaving, v=2; not given, so Megatron's defaults: gradients "
                    "reduced in fp32 (bf16), micro-batch 1; the distributed optimizer (zero=1) with "
                    "--overlap-param-gather, which the README names; fused kernels (compile); "
                    "Transformer Engine's cuDNN fused attention (attn=cudnn), Megatron's default backend with TE; "
                    "--tp-comm-overlap, which the README names, priced as atp=1 (PyTorch's forward-only "
                    "overlap: Megatron's also overlaps parts of the backward, not modelled)")


MEGATRON_BRIDGE = ("Megatron-Bridge performance summary, 25.09 NeMo container, DGX-H100 table "
                   "(docs/performance-summary.md of github.com/NVIDIA-NeMo/Megatron-Bridge at commit fa0315ae2, "
                   "2025-10-10; now in docs/performance-summary-archive.md; "
                   "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html) and its "
                   "recipes at that commit: scripts/performance/configs/{qwen3/qwen3_30b_a3b,"
                   "deepseek/deepseek_v3}_llm_pretrain.yaml, scripts/performance/run_script.py, "
                   "src/megatron/bridge/recipes/{qwen/qwen3_moe,deepseek/deepseek_v3}.py")
MOE_COMMON = ("precision fp8: the table has no precision column; its MBS 2 for Qwen3 is the yaml's fp8_cs entry "
              "(bf16 has MBS 1) and its note on the parentheses names the FP8 granularities, so per-tensor "
              "current-scaling FP8; the distributed optimizer (zero=1) with overlap_param_gather (opg=1), as the "
              "recipes set; Megatron's rank order (pipeline outermost, experts folded with ep innermost: "
              "order=megatron); fused kernels (compile); balanced routing (the summary: 'we force-balance the "
              "token distribution'); gradients priced in fp32 (the recipes reduce them in bf16) and the "
              "experts' all-to-all in bf16; TE's cuDNN fused attention (attn=cudnn)")

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("Megatron GPT-3 177B, 96 H100 (strong scaling)", "gpt-175b", "h100", 96,
                 "dp=2,tp=8,pp=6,m=576,v=2,interleaved,zero=1,opg=1,ac=none,precision=bf16,attn=cudnn,atp=1", 1152,
                 4096, "mfu", 0.47,
                 MEGATRON, compile=True, role="fit", assumed=MEGATRON_ASSUMED),
    PublishedRun("Megatron GPT-3 177B, 2304 H100 (model table)", "gpt-175b", "h100", 2304,
                 "dp=48,tp=8,pp=6,m=24,v=2,interleaved,zero=1,opg=1,ac=none,precision=bf16,attn=cudnn,atp=1", 1152,
                 4096, "mfu", 0.44,
                 MEGATRON, compile=True, assumed=MEGATRON_ASSUMED),
    PublishedRun("Megatron GPT-3 177B, 4608 H100 (strong scaling)", "gpt-175b", "h100", 4608,
                 "dp=96,tp=8,pp=6,m=12,v=2,interleaved,zero=1,opg=1,ac=none,precision=bf16,attn=cudnn,atp=1", 1152,
                 4096, "mfu", 0.42,
                 MEGATRON, compile=True, assumed=MEGATRON_ASSUMED),
    # mixtures of experts
    PublishedRun("Megatron-Bridge Qwen3-30B-A3B, 16 H100 (25.09, token-drop)", "qwen3-30b-a3b", "h100", 16,
                 "dp=8,pp=2,m=32,v=24,interleaved,ep=8,zero=1,opg=1,ac=none,precision=fp8,order=megatron,attn=cudnn",
                 512, 4096,
                 "tokens_per_s_per_gpu", 10494, MEGATRON_BRIDGE, compile=True, memory_comparable=False,
                 assumed="TP1 PP2 VP24 EP8 (ETP1) CP1, MBS 2, GBS 512, GA 32, seq 4096 from the table and the yaml; no "
                         "recomputation (the yaml sets recompute_granularity null); token drop at capacity factor 1 "
                         "padded to capacity (apply_moe_token_drop), which under balanced routing computes and sends "
                         "what dropless does; alltoall dispatcher; " + MOE_COMMON),
    PublishedRun("Megatron-Bridge DeepSeek-V3, 1024 H100 (25.09, dropless)", "deepseek-v3", "h100", 1024,
                 "dp=64,tp=2,pp=8,m=128,v=4,interleaved,uneven=1,ep=64,epo=1,zero=1,opg=1,ac=op,precision=fp8,"
                 "order=megatron,attn=cudnn",
                 8192, 4096, "tokens_per_s_per_gpu", 1297, MEGATRON_BRIDGE, compile=True,
                 memory_comparable=False,
                 assumed="TP2 PP8 VP4 EP64 (ETP1) CP1, MBS 1, GBS 8192, GA 128, seq 4096 from the table and the yaml; "
                         "DeepEP dispatcher with the EP all-to-all overlapped with the other micro-batch's compute "
                         "(run_script.py on H100: overlap_moe_expert_parallel_comm, delay_wgrad_compute: epo=1); "
                         "selective recomputation of mla_up_proj and the dense MLPs priced as ac=op (no matmul "
                         "recomputed); the pipeline layout Et|(tt|)*30mL (about 2 layers a chunk, the multi-token "
                         "prediction layer and the loss on the last) priced as 8 MoE layers plus the head on the "
                         "busiest rank, without the MTP layer; overlap_grad_reduce off on H100 not modelled (the "
                         "dp reduction, 0.2 s of 25 s, is priced overlapped); DeepEP's per-node deduplication of "
                         "tokens not modelled; " + MOE_COMMON),
)
