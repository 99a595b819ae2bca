"""Megatron-LM's weak-scaling table of April 2021: GPT models of 1.7B to 1T parameters on 32 to 3,072
A100-80GB GPUs of NVIDIA's Selene (README of github.com/NVIDIA/Megatron-LM at commit b83477a3e8, the
table ``images/cases_april2021.png``; the method: Narayanan et al., arXiv 2104.04473). Every row of the
table is here (one rule, not chosen by error). What the table leaves unstated is in ``ASSUMED``."""

from __future__ import annotations

from .architectures import MEGATRON_2021_SHAPES
from .published_run import PublishedRun

SOURCE = ("Megatron-LM README at commit b83477a3e8 (github.com/NVIDIA/Megatron-LM, 2022-05-19; the table "
          "images/cases_april2021.png, added in 50a4b5fa02, 2021-04-08): 'Achieved teraFLOPs per GPU' by the "
          "paper's count with recomputation (Narayanan et al., arXiv 2104.04473, equation 3); vocabulary 51,200, "
          "sequence 2048, 8 A100 80GB a node (Selene: 8 x 200 Gb/s HDR InfiniBand); 'For numbers larger than "
          "8, typically tensor parallel of size 8 was used' (model-parallel 16 = TP 8 x PP 2, ..., 280 = TP 8 x "
          "PP 35)")
ASSUMED = ("Megatron's code of the time (commit 50a4b5fa02) with its example GPT-3 script "
           "(examples/pretrain_gpt3_175B.sh: --micro-batch-size 1, --fp16, --checkpoint-activations): micro-batch 1, "
           "fp16 (priced as bf16, the same tensor-core rate), full recomputation (ac=full; the table's FLOPs count "
           "it), the 1F1B schedule (no virtual stages set), no sequence parallelism (sp=0; it came in 2022), no "
           "distributed optimizer (zero=0); its unfused attention with the fused causal softmax and the default "
           "attention dropout 0.1 (attn=unfused); fused bias-GeLU, bias-dropout-add and LayerNorm (compile); "
           "heads from the paper's Table 1 (the README's table omits them); not modelled: the hidden dropouts' "
           "one-byte masks, the fp16 gradients all-reduced after the backward rather than fp32 buckets behind it "
           "(within 2 % of these steps either way), the pipeline's scatter-gather of each send over the tp ranks "
           "(the sends are 2-5 % of the pipelined steps), the tied embedding's all-reduce between the first and "
           "last stages")

# size: (tp, pp, GPUs, global batch, achieved TFLOP/s per GPU), the table's rows in order
TABLE = {"1.7b": (1, 1, 32, 512, 137), "3.6b": (2, 1, 64, 512, 138), "7.5b": (4, 1, 128, 512, 142),
         "18b": (8, 1, 256, 1024, 135), "39b": (8, 2, 512, 1536, 138), "76b": (8, 4, 1024, 1792, 140),
         "145b": (8, 8, 1536, 2304, 148), "310b": (8, 16, 1920, 2160, 155), "530b": (8, 35, 2520, 2520, 163),
         "1t": (8, 64, 3072, 3072, 163)}


def _row(size: str) -> PublishedRun:
    tp, pp, gpus, batch, tflops = TABLE[size]
    dp = gpus // (tp * pp)
    layout = (f"dp={dp},tp={tp},pp={pp},m={batch // dp},sp=0,zero=0,ac=full,precision=bf16,attn=unfused,"
              "order=megatron")
    return PublishedRun(f"Megatron-LM GPT {size.upper()}, {gpus} A100 (2021 weak scaling)", f"megatron-2021-gpt-{size}",
                        "a100", gpus, layout, batch, 2048, "megatron_tflops", tflops, SOURCE, compile=True,
                        memory_comparable=False, assumed=ASSUMED)


assert set(TABLE) == set(MEGATRON_2021_SHAPES)
RUNS: tuple[PublishedRun, ...] = tuple(_row(size) for size in TABLE)
