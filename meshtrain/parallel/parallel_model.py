"""A Llama on a (dp, pp, cp, tp) mesh, ready to train: build, one forward/backward step, optimizer.

The step takes the *global* batch, so every layout sees the same data: this rank keeps its dp rows
and its cp share of the sequence, splits the rows into micro-batches and runs its pipeline
schedule. Each micro-batch's loss is its token-loss sum divided by the rank's token count, so the
micro-batches add up to the rank's mean; averaging gradients over dp x cp then gives exactly the
gradient of the global mean that one process computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..errors import ConfigError
from ..mesh import Mesh
from ..config.parallel import check_expert_parallel
from ..models.llama import Llama, LlamaConfig
from ..models.moe import MoEStats, MoEStepInfo, finish_moe_step, set_moe_step
from ..placement import placement_of
from .context import cp_positions, cp_shard
from .data import DataParallel
from .expert import add_expert_views
from .parallelize import ZERO_VIEW, ParallelConfig, autocast_dtype, parallelize
from .pipeline.engine import PipelineEngine, StepStats
from .pipeline.partition import split_stages
from .pipeline.schedule import build_schedule, check_schedule
from .precision import DynamicLossScaler
from .tensor import vocab_parallel_cross_entropy
from .zero import ZeroModel, ZeroOptimizer


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a ``DataParallel`` / ``ZeroModel`` wrapper."""
    return module.module if isinstance(module, (DataParallel, ZeroModel)) else module


class ParallelModel:
    """This rank's part of a Llama under a mesh: its pipeline stages (one per virtual stage),
    each tensor/context/data parallel as configured, and the schedule that runs them."""

    def __init__(self, cfg: LlamaConfig, mesh: Mesh, config: ParallelConfig | None = None, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.cfg, self.mesh, self.config = cfg, mesh, config or ParallelConfig()
        pc = self.config
        v = pc.virtual_stages
        self.n_stages = mesh.pp * v
        self.schedule = build_schedule(pc.schedule, mesh.pp, pc.microbatches, v)
        check_schedule(self.schedule, mesh.pp, pc.microbatches, v)
        self.actions = self.schedule[mesh.coords.pp]
        if cfg.n_experts:
            check_expert_parallel(cfg, mesh.ep)
            add_expert_views(mesh)  # collective: before any stage, on every rank
        with torch.device("meta"):
            full = Llama(cfg)
        ids = [c * mesh.pp + mesh.coords.pp for c in range(v)]
        parts = split_stages(full, self.n_stages, ids)
        self.stages: dict[int, nn.Module] = {s: parallelize(m, mesh, pc, seed, device) for s, m in parts.items()}
        self.engine = PipelineEngine(self.stages, self.n_stages, lambda s: mesh.stage_rank(s % mesh.pp),
                                     mesh.pp_group, self._loss, autocast_dtype(pc.precision))
        self._tokens_per_rank = 1
        self.last_stats: StepStats | None = None
        self.moe_stats: MoEStats | None = None
        """The last step's mixture-of-experts statistics of every layer of the model (the same on
        every rank): tokens per expert, dropped tokens, auxiliary loss; None for a dense model."""

    # -- data ------------------------------------------------------------------------------------

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows (dp) and sequence share (cp) of a global batch, and their positions."""
        mesh, b, s = self.mesh, tokens.shape[0], tokens.shape[1]
        if b % (mesh.dp * self.config.microbatches):
            raise ConfigError(f"global batch {b} is not divisible by dp x microbatches = {mesh.dp} x "
                              f"{self.config.microbatches}; use a batch size that is a multiple of "
                              f"{mesh.dp * self.config.microbatches}")
        if s > self.cfg.max_seq_len:  # on the host: the model's own check skips device positions
            raise ValueError(f"position {s - 1} exceeds max_seq_len={self.cfg.max_seq_len}; use shorter "
                             f"sequences or raise model.max_seq_len")
        rows = b // mesh.dp
        tokens = tokens[mesh.coords.dp * rows : (mesh.coords.dp + 1) * rows]
        targets = targets[mesh.coords.dp * rows : (mesh.coords.dp + 1) * rows]
        if mesh.cp > 1:
            return cp_shard(tokens, mesh.cp_group, 1), cp_shard(targets, mesh.cp_group, 1), \
                cp_positions(s, mesh.cp_group, device=tokens.device)
        return tokens, targets, torch.arange(s, device=tokens.device)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.mesh.tp > 1:
            total = vocab_parallel_cross_entropy(logits.float(), target, self.mesh.tp_group, reduction="sum")
        else:
            total = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum")
        return total / self._tokens_per_rank

    # -- the step --------------------------------------------------------------------------------

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one global batch (batch, seq); gradients end reduced over dp x cp,
        multiplied by ``loss_scale`` (fp16 loss scaling: ``ParallelOptimizer.unscale_`` divides
        it out). Returns the global mean loss, unscaled (the same value on every rank)."""
        tok, tgt, pos = self.local_batch(tokens, targets)
        self._tokens_per_rank = tgt.numel()
        m = self.config.microbatches
        if self.cfg.n_experts:
            info = MoEStepInfo(global_rows=tokens.shape[0], microbatches=m, shares=self.mesh.size("dp_cp"),
                               loss_scale=loss_scale)
            for stage in self.stages.values():
                set_moe_step(unwrap(stage), info)
        loss, self.last_stats = self.engine.run(self.actions, list(tok.chunk(m)), list(tgt.chunk(m)),
                                                {"positions": pos}, signature=(tuple(tokens.shape), m),
                                                loss_scale=loss_scale)
        if self.cfg.n_experts:
            self.moe_stats = self._finish_moe_step()
        if self.mesh.pp > 1:  # only the last stage has it
            comm.all_reduce(loss, group=self.mesh.pp_group)
        if self.mesh.dp_cp.size > 1:
            comm.all_reduce(loss, group=self.mesh.dp_cp)
            loss /= self.mesh.dp_cp.size
        return loss

    def _finish_moe_step(self) -> MoEStats | None:
        """After the step's backwards, before the optimizer: sum each layer's token counts (and
        dropped tokens, auxiliary loss) over the ranks that saw other tokens, update the routing
        bias from them, and gather every stage's layers into one table (the same on every rank)."""
        mesh = self.mesh
        summed = mesh.group("dp_cp_tp")

        @torch.compiler.disable
        def reduce(t: torch.Tensor) -> torch.Tensor:
            comm.all_reduce(t, op="sum", group=summed)
            return t

        stages = nn.ModuleList([unwrap(m) for m in self.stages.values()])
        local = finish_moe_step(stages, reduce)
        e = self.cfg.n_experts
        table = torch.zeros(self.cfg.n_layers, e + 2, dtype=torch.float64, device=self.engine.device)
        if local is not None:
            table[local.layers] = torch.cat([local.counts, local.dropped[:, None], local.aux[:, None]], 1).to(table.device)
        if mesh.pp > 1:
            comm.all_reduce(table, op="sum", group=mesh.pp_group)
        moe_rows = [i for i in range(self.cfg.n_layers) if self.cfg.is_moe_layer(i)]
        table = table[moe_rows]
        return MoEStats(counts=table[:, :e], dropped=table[:, e], aux=table[:, e + 1],
                        names=[f"layers.{i}.mlp" for i in moe_rows])

    # -- parameters ------------------------------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(full-model name, local parameter) of every stage; ``p.placement`` says which slice."""
        out: dict[str, nn.Parameter] = {}
        for m in self.stages.values():
            for n, p in unwrap(m).named_parameters():
                out.setdefault(n, p)
        return list(out.items())

    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                        **kwargs: Any) -> "ParallelOptimizer":
        """One optimizer over this rank's parameters (ZeRO: one sharded optimizer per stage)."""
        return ParallelOptimizer(self, optimizer_cls, **kwargs)


class ParallelOptimizer:
    """Steps every local stage's parameters: a plain torch optimizer, or ``ZeroOptimizer`` shards."""

    def __init__(self, model: ParallelModel, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.model = model
        if model.config.zero_stage:
            self.optimizers: list[Any] = [ZeroOptimizer(m, optimizer_cls, **kwargs) for m in model.stages.values()]
        else:
            self.optimizers = [optimizer_cls([p for _, p in model.named_parameters()], **kwargs)]
        # the mesh axes the global grad norm sums over, fixed once the model is built: every axis
        # along which some piece of this stage differs (a placement's split, ZeRO's shards), from
        # the stage's parameters, not this rank's pieces, so that every rank of a stage reduces
        # over the same axes; pp last, once the stage's sum is whole
        mesh = model.mesh
        distinct = [placement_of(p).sharded_over for _, p in model.named_parameters()]
        distinct += [{u.view or ZERO_VIEW} for o in self.optimizers if isinstance(o, ZeroOptimizer) for u in o.model.units]
        used = mesh.axes_of(set().union(*distinct)) if distinct else frozenset()
        self._norm_axes = [a for a in mesh.axes if a in used and a != "pp" and mesh.size(a) > 1]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every part's param groups (set ``lr`` here)."""
        return [g for o in self.optimizers for g in o.param_groups]

    def _grad_pieces(self) -> list[tuple[torch.Tensor, frozenset[str]]]:
        """(gradient piece, the mesh axes along which ranks hold different pieces): the placement's
        split axes, plus ZeRO's sharding view for pieces of a flat master shard."""
        out = []
        if not self.model.config.zero_stage:
            for _, p in self.model.named_parameters():
                if p.grad is not None:
                    out.append((p.grad, placement_of(p).sharded_over))
            return out
        for zo in self.optimizers:  # this rank's slice [lo, lo + shard) of each unit's flat gradient
            zo.model.reduce_replicas()
            for u in zo.model.units:
                g = u.grad  # on the compute device, offloaded or not
                if g is None:
                    continue
                for p, off in zip(u.params, u.offsets):
                    a, b = max(off, u.lo), min(off + p.numel(), u.lo + u.shard_size)
                    if a < b:
                        out.append((g[a - u.lo : b - u.lo], placement_of(p).sharded_over | {u.view or ZERO_VIEW}))
        return out

    def unscale_(self, scaler: DynamicLossScaler) -> torch.Tensor:
        """fp16: divide the gradient pieces this rank holds (ZeRO: its shards, replicas averaged
        first) by the loss scale; return the overflow flag agreed over the whole world (a float32
        tensor of one element on the device, 1: some rank saw inf/NaN), so that every rank skips
        the same steps. Call it before ``clip_grad_norm_``. Collective over the world; no host read."""
        found = scaler.unscale_([g for g, _ in self._grad_pieces()], self.model.engine.device)
        return scaler.agree(found, self.model.mesh.comm.world)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the whole model's gradient (over tp slices, pipeline stages and
        ZeRO shards, each counted once), as a 0-d float64 tensor on the gradients' device; scales
        the gradients down to ``max_norm`` if larger (``max_norm <= 0``: measure only). Like
        ``torch.nn.utils.clip_grad_norm_`` it never reads the norm on the host (no device sync):
        the scale is min(1, max_norm / norm) computed on the device. Collective over the mesh.

        Squares are summed over the mesh axes along which ranks hold different pieces (every axis a
        placement or ZeRO splits over, then pp); a piece replicated along such an axis is weighted
        by 1 / its size there, so that every element counts once."""
        mesh = self.model.mesh
        pieces = self._grad_pieces()
        device = pieces[0][0].device if pieces else self.model.engine.device
        axes = self._norm_axes
        sq = torch.zeros((), dtype=torch.float64, device=device)
        by_weight: dict[tuple[float, torch.dtype], list[torch.Tensor]] = {}
        for g, distinct in pieces:
            apart = mesh.axes_of(distinct)
            w = 1.0 / math.prod(mesh.size(a) for a in axes if a not in apart)
            by_weight.setdefault((w, g.dtype), []).append(g)
        for (w, _), grads in by_weight.items():  # one foreach kernel per weight (as torch's clip), summed in float64
            sq += torch.stack(torch._foreach_norm(grads)).double().square().sum() * w
        for axis in axes + (["pp"] if mesh.pp > 1 else []):
            comm.all_reduce(sq, group=mesh.group(axis))
        norm = sq.sqrt()
        if max_norm > 0 and pieces:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            with torch.no_grad():
                for dtype in {g.dtype for g, _ in pieces}:
                    torch._foreach_mul_([g for g, _ in pieces if g.dtype == dtype], coef.to(dtype))
        return norm

    def step(self) -> None:
        """One optimizer step on every part."""
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        """Clear the gradients (set them to None)."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
