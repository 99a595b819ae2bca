"""Megatron-LM's and Megatron-Bridge's published runs on H100: GPT-3 177B strong scaling and the weak-scaling
model table, GPT 1.7B-462B (Megatron-LM README), and every DGX-H100 row of Megatron-Bridge's 25.09 performance summary (Llama 3 8B, 70B, 405B,
Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3). Sources and what each leaves unstated are in the
constants below and in docs/plan.md."""

from __future__ import annotations

from .architectures import ARCHS
from .layout import fewest_even_chunks
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
                    "--tp-comm-overlap, which the README names: Transformer Engine's userbuffers with their default "
                    "methods, forward and backward (atp=1,atpb=1; without --tp-comm-overlap-cfg Megatron passes TE "
                    "no settings: megatron/training/initialize.py at 937571cfd4)")

MODEL_TABLE_ASSUMED = ("the README's model table (images/model_table.png, commit 937571cfd4) gives heads, hidden "
                       "size, layers, TP, PP, DP, GPUs and batch; vocabulary 131,072 and seq 4096 from its text; "
                       "priced as the 177B rows (above): micro-batch 1, gradients reduced in fp32, the distributed "
                       "optimizer with --overlap-param-gather (zero=1, opg=1), cuDNN attention, fused kernels, "
                       "--tp-comm-overlap as atp=1,atpb=1 where tp > 1, and under a pipeline the least interleaving that "
                       "splits the layers evenly (v=2; 119B: 92 layers over PP 4 allow only v=23, 462B: 112 over PP 16 "
                       "only v=7) with ppo=1; the output head untied (the table's sizes count it)")
MODEL_TABLE = {"1.7b": (1, 1, 192, 0.41), "7.1b": (2, 1, 192, 0.47), "16b": (4, 1, 192, 0.49),
               "32b": (8, 1, 192, 0.46), "70b": (8, 2, 384, 0.42), "119b": (8, 4, 768, 0.43),
               "314b": (8, 8, 1536, 0.48), "462b": (8, 16, 3072, 0.47)}
"""size: (TP, PP, batch, MFU) of the model table's rows but the 177B (DP 48 in every row)."""


def _model_table_row(size: str) -> PublishedRun:
    tp, pp, batch, mfu = MODEL_TABLE[size]
    layers = ARCHS[f"megatron-2024-gpt-{size}"].n_layers
    layout = f"dp=48,tp={tp},pp={pp},m={batch // 48},zero=1,opg=1,ac=none,precision=bf16,attn=cudnn"
    if tp > 1:
        layout += ",atp=1,atpb=1"
    if pp > 1:
        layout += f",interleaved,v={fewest_even_chunks(layers, pp)},ppo=1"
    return PublishedRun(f"Megatron GPT {size.upper()}, {48 * tp * pp} H100 (model table)", f"megatron-2024-gpt-{size}",
                        "h100", 48 * tp * pp, layout, batch, 4096, "mfu", mfu, MEGATRON, compile=True,
                        assumed=MODEL_TABLE_ASSUMED, memory_comparable=False)


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

BRIDGE_DENSE = ("precision fp8 with per-tensor current scaling, as for the MoE rows (the 25.11 table names it "
                "FP8-CS for the same H100 rows; 725-763 model TFLOP/s/GPU is beyond BF16); no recomputation (the "
                "Llama recipes and yamls set none); gradients reduced in bf16 (grad_reduce_in_fp32: false; priced "
                "in fp32); TE's cuDNN fused attention (attn=cudnn); fused kernels (compile); Megatron's rank order "
                "(order=megatron)")
BRIDGE_PP = ("the distributed optimizer (zero=1) with overlap_param_gather (opg=1) from llama3.py; "
             "tp_comm_overlap on (the recipe's CommOverlapConfig) priced as atp=1,atpb=1: TE's userbuffers "
             "forward and backward, at TE's default SMs (the recipe's per-model userbuffer configs set their own)")


def _bridge(name: str, model: str, gpus: int, layout: str, batch: int, seq: int, tps: float, assumed: str) -> PublishedRun:
    return PublishedRun(f"Megatron-Bridge {name}, {gpus} H100 (25.09)", model, "h100", gpus,
                        layout + ",ac=none,precision=fp8,attn=cudnn,order=megatron", batch, seq,
                        "tokens_per_s_per_gpu", tps, MEGATRON_BRIDGE, compile=True, memory_comparable=False,
                        assumed=assumed)


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("Megatron GPT-3 177B, 96 H100 (strong scaling)", "gpt-175b", "h100", 96,
                 "dp=2,tp=8,pp=6,m=576,v=2,interleaved,ppo=1,zero=1,opg=1,ac=none,precision=bf16,attn=cudnn,atp=1,atpb=1", 1152,
                 4096, "mfu", 0.47,
                 MEGATRON, compile=True, role="fit", assumed=MEGATRON_ASSUMED, memory_comparable=False),
    PublishedRun("Megatron GPT-3 177B, 2304 H100 (model table)", "gpt-175b", "h100", 2304,
                 "dp=48,tp=8,pp=6,m=24,v=2,interleaved,ppo=1,zero=1,opg=1,ac=none,precision=bf16,attn=cudnn,atp=1,atpb=1", 1152,
                 4096, "mfu", 0.44,
                 MEGATRON, compile=True, assumed=MEGATRON_ASSUMED, memory_comparable=False),
    PublishedRun("Megatron GPT-3 177B, 4608 H100 (strong scaling)", "gpt-175b", "h100", 4608,
                 "dp=96,tp=8,pp=6,m=12,v=2,interleaved,ppo=1,zero=1,opg=1,ac=none,precision=bf16,attn=cudnn,atp=1,atpb=1", 1152,
                 4096, "mfu", 0.42,
                 MEGATRON, compile=True, assumed=MEGATRON_ASSUMED, memory_comparable=False),
    # the model table's other rows (weak scaling, 48 data-parallel replicas each)
    *(_model_table_row(size) for size in MODEL_TABLE),
    # Megatron-Bridge 25.09, DGX-H100: the dense rows (recipes: scripts/performance/configs/llama3/
    # llama3_{8b,70b}_llm_pretrain.yaml, llama31/llama31_405b_llm_pretrain.yaml, recipes/llama/llama3.py)
    _bridge("Llama3 8B", "llama3-8b", 8, "dp=8,m=16,zero=3", 128, 8192, 14079,
            "FSDP 1 = Megatron FSDP (use_megatron_fsdp: true in the yaml's fp8 entries; bf16 runs CP 2 "
            "without it), priced as ZeRO-3 gathering and reduce-scattering each of the 16 micro-batches "
            "(GA 16, MBS 1); " + BRIDGE_DENSE),
    _bridge("Llama3 70B", "llama3-70b", 64, "dp=2,tp=4,pp=8,m=64,interleaved,ppo=1,v=5,zero=1,opg=1,atp=1,atpb=1", 128, 8192,
            1619, "TP 4, PP 8, VP 5 (the yaml's fp8 entries; bf16 runs PP 4 CP 2), GA 64, MBS 1; " + BRIDGE_PP +
            "; " + BRIDGE_DENSE),
    _bridge("Llama3.1 405B", "llama3-405b", 1024,
            "dp=8,tp=8,pp=8,cp=2,m=64,interleaved,ppo=1,v=8,uneven=1,zero=1,opg=1,atp=1,atpb=1", 512, 8192, 302,
            "TP 8, PP 8, CP 2, VP 8, GA 64, MBS 1; the recipe's account_for_embedding_in_pipeline_split and "
            "account_for_loss_in_pipeline_split (126 layers + 2 over 64 chunks: 16 layers on the busiest rank) "
            "priced as uneven=1 (the same 16); TE's ring attention over the kv heads (cpag=0, no kvrep); "
            + BRIDGE_PP + "; " + BRIDGE_DENSE),
    # mixtures of experts
    PublishedRun("Megatron-Bridge Qwen3-30B-A3B, 16 H100 (25.09, token-drop)", "qwen3-30b-a3b", "h100", 16,
                 "dp=8,pp=2,m=32,v=24,interleaved,ppo=1,ep=8,zero=1,opg=1,ac=none,precision=fp8,order=megatron,attn=cudnn",
                 512, 4096,
                 "tokens_per_s_per_gpu", 10494, MEGATRON_BRIDGE, compile=True, memory_comparable=False,
                 assumed="TP1 PP2 VP24 EP8 (ETP1) CP1, MBS 2, GBS 512, GA 32, seq 4096 from the table and the yaml; no "
                         "recomputation (the yaml sets recompute_granularity null); token drop at capacity factor 1 "
                         "padded to capacity (apply_moe_token_drop), which under balanced routing computes and sends "
                         "what dropless does; alltoall dispatcher; " + MOE_COMMON),
    PublishedRun("Megatron-Bridge Qwen3-235B-A22B, 256 H100 (25.09, token-drop)", "qwen3-235b-a22b", "h100", 256,
                 "dp=16,tp=2,pp=8,m=128,interleaved,ppo=1,v=4,uneven=1,ep=32,zero=1,opg=1,atp=1,atpb=1,ac=none,precision=fp8,"
                 "order=megatron,attn=cudnn",
                 2048, 4096, "tokens_per_s_per_gpu", 1204, MEGATRON_BRIDGE, compile=True, memory_comparable=False,
                 assumed="TP2 PP8 VP4 EP32 ETP1 CP1, MBS 1, GBS 2048, GA 128, seq 4096 from the table and "
                         "qwen3_235b_a22b_llm_pretrain.yaml; ep folded over tp x dp (Megatron's expert grid with "
                         "ETP 1); no recomputation (the yaml sets recompute_granularity null); the recipe's "
                         "account_for_embedding/loss_in_pipeline_split (94 layers + 2 over 32 chunks: 12 on the "
                         "busiest rank) priced as uneven=1; token drop at capacity factor 1 padded to capacity, "
                         "alltoall dispatcher (run_script.py, as Qwen3-30B); tp_comm_overlap on priced as atp=1,atpb=1; "
                         + MOE_COMMON),
    PublishedRun("Megatron-Bridge DeepSeek-V3, 1024 H100 (25.09, dropless)", "deepseek-v3", "h100", 1024,
                 "dp=64,tp=2,pp=8,m=128,v=4,interleaved,ppo=1,uneven=1,ep=64,epo=1,zero=1,opg=1,ac=op,precision=fp8,"
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
