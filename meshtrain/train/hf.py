"""Hugging Face Llama <-> meshtrain checkpoints, without ``transformers``.

``export_hf(checkpoint, out)`` assembles every full tensor of a sharded meshtrain checkpoint (any
layout) and writes ``out/config.json`` + ``out/model.safetensors`` that ``transformers`` loads as
``LlamaForCausalLM`` with the same logits, plus the run's tokenizer when it can be found.
``read_hf(hf_dir)`` is the inverse: a ``LlamaConfig`` and meshtrain-named full tensors, which
``write_init_checkpoint`` stores as a step-0 checkpoint that ``meshtrain train`` resumes under any
layout (``meshtrain import`` does both, see ``hf_cli.py``). Mixture-of-experts models map to
transformers MoE classes instead (``hf_moe.py``; the functions here dispatch on ``n_experts``).

The one non-trivial step is the rotary layout: meshtrain's ``apply_rotary`` rotates interleaved
pairs (x[2i], x[2i+1]) while HF's ``rotate_half`` rotates (x[i], x[i + d/2]). The q and k
projections' rows are therefore permuted per head on the way out (Meta -> HF: rows 0, 2, ..., d-2,
1, 3, ..., d-1) and back on the way in, which leaves q·k, and so the logits, unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from ..errors import CheckpointError, ConfigError
from ..models.llama import Llama, LlamaConfig
from .checkpoint import _resolve, commit_step_dir, latest_checkpoint
from .checkpoint_io import (FORMAT, VERSION, CheckpointReader, fsync_dir, merge_sidecars, step_dir_name, to_json,
                            write_durable, write_rank_shard)
from .config import Config, from_dict, model_config, to_dict

__all__ = ["to_hf_permute", "from_hf_permute", "hf_config", "to_hf_state", "from_hf_state", "read_checkpoint",
           "build_llama", "locate_tokenizer", "export_hf", "read_hf", "llama_config_from_hf",
           "write_init_checkpoint", "prepare_out_dir", "check_fits", "llama_fields_from_hf"]

HF_CONFIG, HF_WEIGHTS, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
          "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
          "mlp.w2.weight": "mlp.down_proj.weight"}
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


# -- names and the rotary permutation --------------------------------------------------------------


def to_hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection reordered per head from interleaved rotary pairs to HF's halves:
    HF row ``a * d/2 + i`` is meshtrain row ``2i + a`` (d = head_dim)."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def from_hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``to_hf_permute``."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, 2, d // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def _hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise CheckpointError(f"the checkpoint holds tensor model/{name}, which has no Hugging Face Llama "
                          f"counterpart; only meshtrain Llama checkpoints can be exported")


def _meshtrain_name(hf: str) -> str | None:
    """The meshtrain name of an HF tensor; None for tensors HF recomputes (rotary ``inv_freq``)."""
    if hf in _TOP_BACK:
        return _TOP_BACK[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m and m.group(2) == "self_attn.rotary_emb.inv_freq":
        return None
    if m and m.group(2) in _LAYER_BACK:
        return f"layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"
    raise ConfigError(f"Hugging Face tensor {hf!r} is not part of a plain Llama (biases, adapters and other "
                      f"architectures cannot be imported)")


def _permuted(name: str) -> bool:
    return name.endswith(("attn.wq.weight", "attn.wk.weight"))


def _heads(name: str, cfg: LlamaConfig) -> int:
    return cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """meshtrain full tensors -> HF ``LlamaForCausalLM`` state (fp32; q/k permuted; with tied
    embeddings no ``lm_head.weight``, as ``save_pretrained`` writes it)."""
    out = {}
    for name, t in tensors.items():
        if cfg.tie_embeddings and name == "head.weight":
            continue
        t = t.to(torch.float32)
        out[_hf_name(name)] = to_hf_permute(t, _heads(name, cfg)) if _permuted(name) else t.contiguous()
    return out


def from_hf_state(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` state -> meshtrain full fp32 tensors, checked against ``cfg``'s shapes."""
    out: dict[str, torch.Tensor] = {}
    for hf, t in state.items():
        name = _meshtrain_name(hf)
        if name is None:
            continue
        t = t.to(torch.float32)
        out[name] = from_hf_permute(t, _heads(name, cfg)) if _permuted(name) else t.contiguous()
    check_fits(out, cfg, _hf_name)
    return out


def check_fits(out: dict[str, torch.Tensor], cfg: LlamaConfig, show: Callable[[str], str]) -> None:
    """``ConfigError`` unless ``out`` holds exactly the model's parameters and routing-bias buffers
    (tied: no ``head.weight``) with its shapes; ``show`` names a tensor in the messages."""
    if cfg.tie_embeddings:
        out.pop("head.weight", None)
    with torch.device("meta"):
        model = Llama(cfg)
    want = dict(model.named_parameters())  # tied: head.weight is a duplicate and left out
    want.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    missing = sorted(set(want) - set(out))
    extra = sorted(set(out) - set(want))
    if missing or extra:
        raise ConfigError(f"the Hugging Face weights do not fit config.json's model: missing "
                          f"{[show(n) for n in missing][:4]}, unexpected {[show(n) for n in extra][:4]}")
    for name, p in want.items():
        if tuple(out[name].shape) != tuple(p.shape):
            raise ConfigError(f"Hugging Face tensor {show(name)} has shape {tuple(out[name].shape)} but "
                              f"config.json implies {tuple(p.shape)}")


# -- configs ---------------------------------------------------------------------------------------


def hf_config(cfg: LlamaConfig, eos_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with ``cfg``'s shape (transformers 4.x and 5.x).
    ``eos_id``: the tokenizer's end-of-text id; written (else null) so that ``generate`` does not stop
    at transformers' default id 2, an ordinary token of meshtrain's tokenizers."""
    return {
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": None,
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "num_hidden_layers": cfg.n_layers, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
    }


def llama_config_from_hf(c: dict[str, Any], where: str = "config.json") -> LlamaConfig:
    """The ``LlamaConfig`` of an HF Llama ``config.json`` (or of a supported MoE class, see
    ``hf_moe``); features meshtrain's Llama lacks (biases, RoPE scaling, other activations, a
    decoupled head_dim) raise ``ConfigError`` rather than being silently dropped."""
    from . import hf_moe

    if hf_moe.hf_class(c) is not None:
        return hf_moe.moe_config_from_hf(c, where)
    arch = c.get("architectures") or []
    if c.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
        raise ConfigError(f"{where}: model_type={c.get('model_type')!r}, architectures={arch}: not a Llama; "
                          f"only LlamaForCausalLM and the MoE classes {', '.join(hf_moe.CLASSES)} can be imported")
    return llama_fields_from_hf(c, where, {"attention_bias": bool(c.get("attention_bias")),
                                           "mlp_bias": bool(c.get("mlp_bias"))})


def llama_fields_from_hf(c: dict[str, Any], where: str, unsupported: dict[str, bool], tie_default: bool = False,
                         **fields: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of the Llama part of ``c`` (sizes, rotary base, norm epsilon, tying;
    ``tie_default`` when ``c`` does not say) with ``fields`` set on top; ``ConfigError`` naming every
    ``unsupported`` feature that is present, or a non-silu activation, RoPE scaling or a decoupled head_dim."""
    ropes = [r for r in (c.get("rope_parameters"), c.get("rope_scaling")) if isinstance(r, dict)]  # 5.x, 4.x
    scaled = any(r.get("rope_type", r.get("type", "default")) != "default" for r in ropes)
    unsupported = {"hidden_act": c.get("hidden_act", "silu") != "silu", **unsupported, "rope scaling": scaled}
    bad = [k for k, v in unsupported.items() if v]
    try:
        dim, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        if c.get("head_dim") not in (None, dim // heads):
            bad.append(f"head_dim={c['head_dim']} != hidden_size/num_attention_heads")
        if bad:
            raise ConfigError(f"{where}: meshtrain's Llama does not implement {', '.join(bad)}; this model "
                              f"cannot be imported")
        theta = next((r["rope_theta"] for r in ropes if "rope_theta" in r), c.get("rope_theta", 10000.0))
        shape = dict(vocab_size=int(c["vocab_size"]), dim=dim, n_layers=int(c["num_hidden_layers"]),
                     n_heads=heads, n_kv_heads=int(c.get("num_key_value_heads") or heads),
                     ffn_dim=int(c["intermediate_size"]), max_seq_len=int(c.get("max_position_embeddings", 2048)),
                     rope_theta=float(theta), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                     tie_embeddings=bool(c.get("tie_word_embeddings", tie_default)))
        return LlamaConfig(**{**shape, **fields})
    except KeyError as e:
        raise ConfigError(f"{where} has no {e.args[0]!r}; it is not a complete Llama config") from None
    except ValueError as e:
        if isinstance(e, ConfigError) and str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None


# -- meshtrain checkpoints -------------------------------------------------------------------------


def read_checkpoint(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor], Config]:
    """A checkpoint's model shape, every full model tensor (by meshtrain name, assembled from the
    shards of any layout) and its run config. ``path`` is a step dir or a root (``latest``)."""
    step_dir = _resolve(path)
    with CheckpointReader(step_dir) as reader:
        config_dict = (reader.meta.get("extra") or {}).get("config")
        if not isinstance(config_dict, dict):
            raise CheckpointError(f"checkpoint {step_dir} has no run config (extra['config']); it was not "
                                  f"written by meshtrain train, so its model shape is unknown")
        tensors = {k.removeprefix("model/"): reader.read(k, [(0, n) for n in reader.global_shape(k)])
                   for k in reader.keys("model/")}
    config = from_dict(config_dict)
    if "tok_emb.weight" not in tensors:
        raise CheckpointError(f"checkpoint {step_dir} has no model/tok_emb.weight; it is not a Llama checkpoint")
    rows = tensors["tok_emb.weight"].shape[0]  # the vocabulary the run used (padded for tp)
    config.model.vocab_size = rows
    cfg = model_config(config, rows)
    return cfg, tensors, config


def build_llama(cfg: LlamaConfig, tensors: dict[str, torch.Tensor]) -> Llama:
    """A plain ``Llama`` holding ``tensors`` (full, meshtrain-named), in eval mode."""
    model = Llama(cfg)
    state = dict(tensors)
    if cfg.tie_embeddings:
        state["head.weight"] = state["tok_emb.weight"]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"the weights do not fit the model config: {e}") from None
    return model.eval()


def locate_tokenizer(config: Config, step_dir: str | Path | None = None) -> Path | None:
    """The ``tokenizer.json`` of a run: the copy its checkpoint ``step_dir`` carries, else
    ``data.tokenizer``, else the cached BPE it trained; None if it is not on this machine (a
    checkpoint older than the copies, and a cleared cache or another corpus)."""
    from .data import open_corpus
    from .tokenizer import bpe_cache_path

    if step_dir is not None and (Path(step_dir) / "tokenizer.json").is_file():
        return Path(step_dir) / "tokenizer.json"
    d = config.data
    if d.tokenizer:
        p = Path(d.tokenizer).expanduser()
        p = p / "tokenizer.json" if p.is_dir() else p
        return p if p.is_file() else None
    try:
        path = bpe_cache_path(open_corpus(d.path, d.max_bytes, d.text_field), d.vocab_size, d.tokenizer_sample_bytes)
    except Exception:  # noqa: BLE001 - a missing corpus just means we cannot find the cache
        return None
    return path if path.is_file() else None


def prepare_out_dir(out: str | Path) -> Path:
    """``out`` as a path that is absent or an empty directory; otherwise ``CheckpointError``."""
    p = Path(out)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise CheckpointError(f"output {p} already exists and is not empty; choose a new --out or delete it")
    return p


def export_hf(checkpoint: str, out: str | Path, tokenizer: str | Path | None = None) -> tuple[Path, str]:
    """Write ``out/config.json``, ``out/model.safetensors`` and (if found) the tokenizer from a
    meshtrain checkpoint; atomic (temp dir, then rename). Returns ``out`` and a note on the tokenizer."""
    out = prepare_out_dir(out)
    cfg, tensors, config = read_checkpoint(checkpoint)
    tok = Path(tokenizer) if tokenizer else locate_tokenizer(config, _resolve(checkpoint))
    eos_id = _eos_id(tok)
    if cfg.n_experts:  # a transformers MoE class, or ConfigError before anything is written
        from .hf_moe import moe_export

        conf, state = moe_export(cfg, tensors, eos_id)
    else:
        conf, state = hf_config(cfg, eos_id), to_hf_state(tensors, cfg)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write_durable(str(tmp / HF_CONFIG), json.dumps(conf, indent=2).encode())
        write_durable(str(tmp / HF_WEIGHTS), st_save(state, metadata={"format": "pt"}))
        if tok is not None and tok.is_file():
            shutil.copyfile(tok, tmp / "tokenizer.json")
            _write_tokenizer_config(tok, tmp)
            note = f"tokenizer from {tok}"
        else:
            note = "no tokenizer: the run's tokenizer.json was not found (pass --tokenizer PATH to include one)"
        fsync_dir(str(tmp))
        if out.exists():
            out.rmdir()  # empty (checked above): rename needs the name free on every platform
        os.rename(tmp, out)
        fsync_dir(str(out.parent))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, note


def _eos_id(tok: Path | None) -> int | None:
    """The end-of-text id of the tokenizer the export includes (None without one)."""
    if tok is None or not tok.is_file():
        return None
    from ..errors import DataError
    from .tokenizer import load_tokenizer

    try:
        return load_tokenizer(tok).eos_id
    except DataError:  # a tokenizer without an end-of-text token: generation then has no stop id
        return None


def _write_tokenizer_config(tok: Path, out: Path) -> None:
    """``tokenizer_config.json`` beside the copied tokenizer: the source's if it has one, else one that
    names the end-of-text token so ``AutoTokenizer`` and meshtrain agree on it."""
    src = tok.parent / "tokenizer_config.json"
    if src.is_file():
        shutil.copyfile(src, out / "tokenizer_config.json")
        return
    from .tokenizer import load_tokenizer

    t = load_tokenizer(tok)
    eos = t.backend.id_to_token(t.eos_id)
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
            "unk_token": eos, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
    write_durable(str(out / "tokenizer_config.json"), json.dumps(conf, indent=2).encode())


# -- Hugging Face directories -> meshtrain -------------------------------------------------------


def read_hf(hf_dir: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A local HF Llama (or supported MoE, ``hf_moe``) directory (``config.json`` +
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``) as a ``LlamaConfig`` and
    meshtrain-named fp32 tensors. Pickled ``pytorch_model.bin`` weights are refused: nothing is
    ever unpickled."""
    d = Path(hf_dir)
    conf_path = d / HF_CONFIG
    if not conf_path.is_file():
        raise ConfigError(f"{d} is not a Hugging Face model directory: it has no {HF_CONFIG}")
    try:
        conf = json.loads(conf_path.read_text(encoding="utf-8"))
        cfg = llama_config_from_hf(conf, str(conf_path))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{conf_path} is not valid JSON: {e}") from None
    if (d / HF_WEIGHTS).is_file():
        files = [d / HF_WEIGHTS]
    elif (d / HF_INDEX).is_file():
        index = json.loads((d / HF_INDEX).read_text(encoding="utf-8"))
        files = [d / f for f in sorted(set(index["weight_map"].values()))]
    else:
        raise ConfigError(f"{d} has no {HF_WEIGHTS} (nor {HF_INDEX}); save the model with safetensors "
                          f"(save_pretrained(..., safe_serialization=True)); pickled .bin files are not read")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    state[key] = st.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for bad files
            raise ConfigError(f"cannot read {f}: {e}") from None
    from . import hf_moe

    arch = hf_moe.hf_class(conf)
    return cfg, (hf_moe.moe_from_hf_state(state, cfg, arch) if arch else from_hf_state(state, cfg))


def write_init_checkpoint(root: str | Path, tensors: dict[str, torch.Tensor], config: Config,
                          extra: dict[str, Any]) -> str:
    """Write ``tensors`` as ``root/step-00000000`` in the sharded format (one rank, whole tensors)
    with an empty optimizer section, and point ``latest`` at it: ``meshtrain train`` with
    ``checkpoint.resume`` resumes it under any layout with fresh AdamW state and the run's own
    hyperparameters. ``extra`` needs the trainer's keys (step, loader, rng); the config is added."""
    root = str(root)
    final = os.path.join(root, step_dir_name(0))
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write_rank_shard(tmp, 0, [(f"model/{n}", t, list(t.shape), tuple((0, d) for d in t.shape))
                                  for n, t in tensors.items()], {})
        entries, files, _ = merge_sidecars(tmp)
        meta = {"format": FORMAT, "version": VERSION, "step": 0,
                "layout": {"dp": 1, "pp": 1, "cp": 1, "tp": 1}, "world_size": 1, "parallel": {},
                "files": files, "entries": entries,
                # an optimizer that has not stepped yet: no state, and no saved hyperparameters, so
                # the run's configured ones apply
                "optimizer": {"param_groups": [], "scalars": {}, "has_state": False},
                "extra": to_json({**extra, "config": to_dict(config)})}
        commit_step_dir(root, tmp, final, meta, keep=1)  # a new run's first and only checkpoint
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert latest_checkpoint(root) == final
    return final
