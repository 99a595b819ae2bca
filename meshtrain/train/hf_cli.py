"""``meshtrain export | import | generate``: Hugging Face Llama directories in and out, and sampling.

- ``export --checkpoint DIR --out HF_DIR``: a checkpoint of any layout -> ``LlamaForCausalLM`` files
  (a mixture-of-experts model: the transformers MoE class that computes it exactly, ``hf_moe.py``).
- ``import HF_DIR [--out RUN_DIR] [--config F] [--section.key=value ...]``: converts the weights
  into ``RUN_DIR/checkpoints/step-00000000`` (fresh optimizer) and trains from it under any layout
  (``--convert-only`` stops after the conversion and prints the ``meshtrain train`` command).
- ``generate --checkpoint DIR --prompt TEXT``: samples a continuation on one process.

Every error exits 2 with the reason and leaves no partial output behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from ..config.model import LlamaConfig

__all__ = ["add_export_arguments", "add_import_arguments", "add_generate_arguments", "main_export",
           "main_import", "main_generate", "import_hf"]

# every LlamaConfig field: each is set by the [model] override of the same name
_SHAPE = tuple(f.name for f in dataclasses.fields(LlamaConfig))
# the fields an import may change: they leave the weights' shapes and values as they are (the
# context length, and the MoE layer's training-time capacity and balancing)
_FREE = ("max_seq_len", "capacity_factor", "aux_loss_coef", "aux_loss_level", "bias_update_rate")


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain export``."""
    p.add_argument("--checkpoint", required=True, help="a checkpoint step dir, or a checkpoints root (follows latest)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write (absent or empty)")
    p.add_argument("--tokenizer", help="tokenizer.json to include (default: the run's, if found)")


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain import`` (every training config key is an option too: --train.steps=100)."""
    p.add_argument("hf_dir", help="a local Hugging Face Llama (or Mixtral, Qwen2-MoE, Ernie 4.5 MoE, GLM-4 MoE) "
                   "directory (config.json + model.safetensors)")
    p.add_argument("--out", help="run directory, absent or empty (default runs/<date-time>)")
    p.add_argument("--config", help="a TOML training config; --section.key=value options override it")
    p.add_argument("--convert-only", action="store_true", help="write the step-0 checkpoint and config.toml, "
                   "do not train")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the workers up to K times after a failure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain generate``."""
    p.add_argument("--checkpoint", required=True, help="a checkpoint step dir, or a checkpoints root (follows latest)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the run's, if found)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")


def _fail(command: str, exc: Exception) -> int:
    print(f"meshtrain {command}: error: {exc}", file=sys.stderr)
    return 2


def main_export(args: argparse.Namespace) -> int:
    """Run ``meshtrain export``."""
    from ..errors import MeshtrainError
    from .hf import export_hf

    try:
        out, note = export_hf(args.checkpoint, args.out, args.tokenizer)
    except MeshtrainError as exc:
        return _fail("export", exc)
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"# wrote {out}/config.json and model.safetensors ({arch}); {note}")
    return 0


def main_generate(args: argparse.Namespace) -> int:
    """Run ``meshtrain generate``: print the prompt and its continuation."""
    from ..errors import ConfigError, MeshtrainError
    from .generate import generate_text, load_for_generation

    try:
        if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
            raise ConfigError(f"--max-new-tokens ({args.max_new_tokens}), --temperature ({args.temperature}) and "
                              f"--top-k ({args.top_k}) must be >= 0")
        model, tok = load_for_generation(args.checkpoint, args.tokenizer, args.device)
        text = generate_text(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    except MeshtrainError as exc:
        return _fail("generate", exc)
    print(text)
    return 0


def _vocab_error(hf_dir: str, vocab: int, why: str) -> Exception:
    """The ConfigError for a tokenizer larger than the imported model's embedding: the model's
    vocabulary is fixed by its weights, so the fix is the tokenizer (or the BPE's size)."""
    from ..errors import ConfigError

    return ConfigError(f"{hf_dir} holds a model of {vocab} tokens (config.json vocab_size, fixed by its weights), "
                       f"but {why}; an import cannot change the model's vocabulary: pass the model's own tokenizer "
                       f"(--data.tokenizer=DIR with its tokenizer.json)"
                       + (f" or a BPE no larger than the model (--data.vocab_size={vocab})" if vocab >= 257 else ""))


def import_hf(hf_dir: str, out: str | None = None, config_path: str | None = None, overrides: list[str] = (),
              convert_only: bool = False, progress: bool = True, max_restarts: int = 0) -> dict[str, Any]:
    """Convert HF Llama weights into a run directory's step-0 checkpoint and (unless
    ``convert_only``) train from it with ``launch``. The model shape comes from ``config.json``;
    the tokenizer from ``hf_dir`` when it has a ``tokenizer.json``. Returns the run's summary, or
    ``{"checkpoint", "run_dir"}`` with ``convert_only``."""
    import torch

    from ..errors import ConfigError
    from .config import load_config, model_config, resolve_out, to_toml, validate
    from .hf import prepare_out_dir, read_hf, write_init_checkpoint
    from .launch import launch
    from .loader import GlobalBatchLoader
    from .tokenizer import prepare_data

    cfg, tensors = read_hf(hf_dir)
    shape = [f"--model.{k}={getattr(cfg, k)}" for k in _SHAPE]
    has_tok = (Path(hf_dir) / "tokenizer.json").is_file()
    tok = [f"--data.tokenizer={Path(hf_dir).resolve()}"] if has_tok else []
    config = load_config(config_path, shape + tok + list(overrides) + ([f"--out={out}"] if out else []), check=False)
    if config.checkpoint.resume not in ("", "auto"):
        raise ConfigError(f"checkpoint.resume = {config.checkpoint.resume!r}: an import starts from the imported "
                          f"weights; drop checkpoint.resume (later runs resume with --checkpoint.resume=auto)")
    config.checkpoint.resume = "auto"  # the trainer finds the step-0 checkpoint as this run's latest
    if config.data.tokenizer:  # data.vocab_size is then unused, but validate() checks the model against it
        config.data.vocab_size = max(257, min(config.data.vocab_size, cfg.vocab_size))
    elif config.data.vocab_size > cfg.vocab_size:  # validate's "raise model.vocab_size" cannot apply to an import
        raise _vocab_error(hf_dir, cfg.vocab_size, f"the BPE it would train asks for data.vocab_size = "
                           f"{config.data.vocab_size}")
    validate(config)
    if not has_tok and not config.data.tokenizer:
        print(f"# note: {hf_dir} has no tokenizer.json; training a BPE on the corpus, whose ids mean nothing to "
              f"the imported model (set --data.tokenizer)", file=sys.stderr)
    resolve_out(config)
    run = prepare_out_dir(config.out)
    config.overwrite = False  # out is empty (checked above), and the launch must keep the step-0 checkpoint
    _, tokenizer, tokens = prepare_data(config.data)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise _vocab_error(hf_dir, cfg.vocab_size, f"the tokenizer has {tokenizer.vocab_size} tokens")
    mc = model_config(config, tokenizer.vocab_size)
    diff = [f"{k}: {getattr(mc, k)} != {getattr(cfg, k)}" for k in _SHAPE if k not in _FREE
            and getattr(mc, k) != getattr(cfg, k)]
    if diff:
        raise ConfigError(f"the [model] settings change the imported model's shape ({'; '.join(diff)}); only "
                          f"model.{', model.'.join(_FREE)} may differ from {hf_dir}/config.json")
    t = config.train
    extra = {"step": 0, "loader": GlobalBatchLoader(tokens, t.seq_len, t.global_batch, seed=t.seed).state_dict(),
             # the trainer seeds torch with train.seed and then restores this: the same state
             "rng": torch.Generator().manual_seed(t.seed).get_state(), "imported_from": str(Path(hf_dir).resolve())}
    created = not run.exists()
    try:
        path = write_init_checkpoint(run / config.checkpoint.dir, tensors, config, extra)
        (run / "config.toml").write_text(to_toml(config))
    except BaseException:
        if created:
            shutil.rmtree(run, ignore_errors=True)
        raise
    if convert_only:
        return {"checkpoint": path, "run_dir": str(run)}
    return launch(config, max_restarts=max_restarts, progress=progress)


def main_import(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``meshtrain import``."""
    from ..errors import MeshtrainError

    try:
        res = import_hf(args.hf_dir, args.out, args.config, overrides, args.convert_only, not args.no_progress,
                        args.max_restarts)
    except MeshtrainError as exc:
        return _fail("import", exc)
    if args.convert_only:
        print(f"# wrote {res['checkpoint']}; train from it with: meshtrain train --config {res['run_dir']}/config.toml")
        return 0
    print(f"# trained {res['steps']} steps from {args.hf_dir} on {res['world_size']} ranks "
          f"({', '.join(f'{k}={v}' for k, v in res['layout'].items())}): loss {res.get('first_loss', float('nan')):.3f}"
          f" -> {res['final_loss']:.3f}")
    print(f"# wrote {res['run_dir']}/metrics.jsonl, loss.png, summary.json, checkpoints/")
    return 0
