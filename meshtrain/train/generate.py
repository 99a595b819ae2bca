"""Sampling text from a trained checkpoint on one process: ``meshtrain generate``.

The whole model is assembled from the shards of any layout (``hf.read_checkpoint``) into a plain
``Llama`` on the CPU (or a given device). The Llama has no KV cache, so every new token runs the
whole (cropped) context again: fine for the small models meshtrain trains on a laptop.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ..errors import DataError
from ..models.llama import Llama
from .checkpoint import _resolve
from .hf import build_llama, locate_tokenizer, read_checkpoint
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["sample_next", "generate_ids", "load_for_generation", "generate_text"]


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """The next token id from the last position's ``logits`` (vocab,): the argmax when
    ``temperature`` is 0, else a draw from softmax(logits / temperature) over the ``top_k`` most
    likely ids (0: all of them)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: Llama, prompt: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 50,
                 seed: int = 0, eos_id: int | None = None) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled ids (stopping after ``eos_id``).
    The context is cropped to the model's ``max_seq_len`` (the newest tokens); the same seed gives
    the same ids."""
    if not prompt:
        raise DataError("the prompt encodes to no tokens; give a non-empty --prompt")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ctx = torch.tensor([ids[-model.cfg.max_seq_len:]], device=device)
        nxt = sample_next(model(ctx)[0, -1], temperature, top_k, gen)
        ids.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return ids


def load_for_generation(checkpoint: str, tokenizer: str | None = None,
                        device: str | torch.device = "cpu") -> tuple[Llama, Tokenizer]:
    """The full model of a checkpoint (step dir or root) and its tokenizer (``tokenizer``, else
    the copy the checkpoint carries, else the run's ``data.tokenizer`` or cached BPE; ``DataError``
    if none is found)."""
    cfg, tensors, config = read_checkpoint(checkpoint)
    # capacity is a training setting: inference routes every token (as the exported model does)
    cfg = dataclasses.replace(cfg, capacity_factor=math.inf)
    path = Path(tokenizer) if tokenizer else locate_tokenizer(config, _resolve(checkpoint))
    if path is None:
        raise DataError(f"the tokenizer of checkpoint {checkpoint} was not found (data.tokenizer = "
                        f"{config.data.tokenizer!r}; a trained BPE lives in the meshtrain cache, which may have been "
                        f"cleared); pass --tokenizer PATH to its tokenizer.json")
    tok = load_tokenizer(path)
    if tok.vocab_size > cfg.vocab_size:
        raise DataError(f"tokenizer {path} has {tok.vocab_size} ids but the model only {cfg.vocab_size}; it is not "
                        f"the tokenizer this checkpoint was trained with")
    return build_llama(cfg, tensors).to(device), tok


def generate_text(model: Llama, tok: Tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0) -> str:
    """``prompt`` and its sampled continuation, decoded."""
    ids = generate_ids(model, tok.encode(prompt), max_new_tokens, temperature, top_k, seed, tok.eos_id)
    return tok.decode(ids)
