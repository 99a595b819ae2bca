"""The mixture-of-experts layer of meshtrain's Llama (DeepSeek-V3 / Qwen3-MoE / Mixtral style).

``MoE`` replaces a block's dense MLP: a router (``moe_routing.py``) picks top-k routed experts per
token, a dispatcher sorts the tokens by expert, ``GroupedExperts`` runs every expert in one grouped
matmul, the dispatcher puts the outputs back and they are summed with the routing weights, plus
the shared experts every token uses.

The layer knows nothing about parallelism. Expert-parallel code configures it from outside:
it replaces ``dispatcher`` (same two methods), holds ``E / ep`` experts in ``experts``, and sets
``reduce_seq_stats`` / ``reduce_batch_stats`` (sums of the balance statistics over the ranks that
hold other tokens of the same sequences / micro-batch) and ``step_info`` (``set_moe_step``).

Load balancing: the auxiliary loss is never returned; its gradient is injected in backward
(``AuxLossInjector``). The auxiliary-loss-free bias is updated once per optimizer step by
``finish_moe_step`` from the expert counts each layer accumulates over the step's forwards.
"""

from __future__ import annotations

import functools
import math
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config.model import LlamaConfig
from .moe_routing import (AuxLossInjector, Router, balance_probs, batch_aux_loss, drop_over_capacity,
                          expert_capacity, sequence_aux_loss)


def identity(t: Tensor) -> Tensor:
    """The default statistics reduction: one process holds all the tokens."""
    return t


def in_backward() -> bool:
    """True inside a backward pass, e.g. while activation checkpointing recomputes a forward: the
    step's statistics were already counted by the real forward."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class MoEStepInfo:
    """How this call's tokens sit in the optimizer step; set from outside before a step."""

    global_rows: int | None = None
    """Sequences in the whole global batch (None: the rows of this call, i.e. one process and one micro-batch)."""
    microbatches: int = 1
    """Micro-batches per step per data-parallel rank."""
    shares: int = 1
    """Data x context parallel ranks the gradients are averaged over: the injected auxiliary-loss
    gradient is multiplied by it so that the average comes out as the sum."""
    loss_scale: float = 1.0
    """The factor the step's losses are multiplied by before backward (fp16 loss scaling): the
    injected auxiliary-loss gradient is scaled alike, as Megatron's MoEAuxLossAutoScaler is."""


@dataclass
class MoEStats:
    """One optimizer step's routing statistics, every MoE layer a row (``finish_moe_step``)."""

    counts: Tensor
    """[layers, E] float64: tokens each expert was chosen by (before capacity dropping)."""
    dropped: Tensor
    """[layers] float64: assignments dropped by capacity."""
    aux: Tensor
    """[layers] float64: the auxiliary loss (the sum of the reduced local parts)."""
    names: list[str] = field(default_factory=list)
    """The layers' module names, in model order."""

    @property
    def layers(self) -> list[int]:
        """The layers' indices in the model (``layers.<i>.mlp`` of each name)."""
        return [int(n.split("layers.")[1].split(".")[0]) for n in self.names]


# ------------------------------------------------------------------------------------------ experts

GROUP_ALIGN = 8
"""Rows per expert group are padded to a multiple of this for ``torch._grouped_mm`` (16 bytes of
bf16, torchtitan's TOKEN_GROUP_ALIGN_SIZE_M): the group starts the kernel reads stay aligned."""


@functools.lru_cache(maxsize=None)
def _grouped_mm_device(index: int) -> bool:
    """Whether CUDA device ``index`` runs the bf16 grouped GEMM kernel (Hopper and later)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def grouped_mm_dtype(x: Tensor, dim: int, hidden: int) -> torch.dtype | None:
    """The dtype ``torch._grouped_mm`` computes this call in, or None where it does not serve: on a
    GPU, Hopper or later with bf16 compute (bf16 inputs or a bf16 autocast); on the CPU, fp32 or
    bf16 (its kernel runs both exactly, a GEMM per group without the padded batch's wasted rows).
    Rows must be 16-byte aligned, as both kernels require."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cuda", "cpu") or x.shape[0] == 0:
        return None  # (no rows: its backward rejects the zero-size gradient; the padded path is free)
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    if dtype not in (torch.float32, torch.bfloat16) or (dim * dtype.itemsize) % 16 or (hidden * dtype.itemsize) % 16:
        return None
    if kind == "cuda" and not (dtype == torch.bfloat16 and _grouped_mm_device(
            x.device.index if x.device.index is not None else torch.cuda.current_device())):
        return None
    return dtype


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (``_grouped_mm``'s backward rejects
    the expanded gradients that e.g. ``out.sum().backward()`` produces)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        """Returns ``x``."""
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        """The gradient, contiguous."""
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stored as stacked weights ([experts, out, in], as ``nn.Linear``
    stores [out, in]): w1, w3 [E, hidden, dim] and w2 [E, dim, hidden]. Expert parallelism makes one
    with the ``E / ep`` experts of a rank."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A standalone default (std 0.02); a model is initialised by name (``llama.init_weights``)."""
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """x: (N, dim) tokens sorted by expert, ``counts[e]`` rows for local expert e. Returns (N, dim):
        w2_e(silu(w1_e x) * w3_e x) of each row's expert, as one grouped matmul."""
        if len(counts) != self.n_experts:
            raise ValueError(f"counts has {len(counts)} entries for {self.n_experts} local experts; "
                             f"give one per expert")
        dtype = grouped_mm_dtype(x, self.dim, self.hidden)
        if dtype is not None:
            return self.grouped_forward(x, counts, dtype)
        return self.padded_forward(x, counts)

    def grouped_forward(self, x: Tensor, counts: list[int], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """``torch._grouped_mm`` over the rows of each expert (offsets = running sums of the counts;
        on a GPU each padded with zero rows to a multiple of ``GROUP_ALIGN`` unless all already
        are); operands cast to ``dtype`` explicitly, as autocast may not list the op."""
        align = GROUP_ALIGN if x.is_cuda else 1
        aligned = [-(-c // align) * align for c in counts]
        slot = None if aligned == counts else self._slots(counts, aligned, x.device)
        xb = x.to(dtype)
        if slot is not None:
            xb = xb.new_zeros(sum(aligned), xb.shape[1]).index_copy(0, slot, xb)
        xb = xb.contiguous()
        offs = torch.tensor(list(itertools.accumulate(aligned)), dtype=torch.int32, device=x.device)
        w1, w3, w2 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch._grouped_mm(xb, w1, offs=offs)) * torch._grouped_mm(xb, w3, offs=offs)
        out = _ContiguousGrad.apply(torch._grouped_mm(h, w2, offs=offs))
        return out if slot is None else out.index_select(0, slot)

    def _slots(self, counts: list[int], group_sizes: list[int], device: torch.device) -> Tensor:
        """Row i of expert e's block of ``counts`` -> its row in a layout whose expert blocks have
        ``group_sizes`` rows (each at least its count): one slot per row, no overlaps."""
        sizes = torch.tensor(counts, dtype=torch.long, device=device)
        group_starts = torch.tensor([0, *itertools.accumulate(group_sizes)][:-1], dtype=torch.long, device=device)
        n = sum(counts)
        expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes, output_size=n)
        row_in_expert = torch.arange(n, device=device) - (sizes.cumsum(0) - sizes)[expert_of_row]
        return group_starts[expert_of_row] + row_in_expert

    def padded_forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """The portable path: rows scattered into an [E, max(counts), dim] zero-padded batch, three
        ``bmm``s, rows gathered back. Every row has its own slot, so both index ops and their
        gradients are free of overlapping writes (deterministic)."""
        d = x.shape[1]
        width = max(counts, default=0)
        slot = self._slots(counts, [width] * self.n_experts, x.device)
        padded = x.new_zeros(self.n_experts * width, d).index_copy(0, slot, x).view(self.n_experts, width, d)
        h = F.silu(torch.bmm(padded, self.w1.transpose(1, 2))) * torch.bmm(padded, self.w3.transpose(1, 2))
        out = torch.bmm(h, self.w2.transpose(1, 2))
        return out.reshape(self.n_experts * width, d).index_select(0, slot)


# --------------------------------------------------------------------------------------- dispatcher

class _DispatchState(NamedTuple):
    """What ``LocalDispatcher.combine`` needs: the assignment id of each dispatched row."""

    order: Tensor
    """(N,) long: assignment ids t * k + j, grouped by expert and in token order within one."""
    assignments: int
    """T * k."""


class GatherTokens(torch.autograd.Function):
    """Rows ``x[order // k]``, with a backward that sums each token's k gradients as a (T, k, dim)
    reduction: deterministic, where ``index_select``'s backward would add overlapping rows."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, k: int) -> Tensor:  # type: ignore[override]
        """x: (T, dim); order: (N,) assignment ids."""
        ctx.save_for_backward(order)
        ctx.k, ctx.tokens = k, x.shape[0]
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        """Each assignment's gradient in its slot, summed over a token's k slots."""
        (order,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.tokens * ctx.k, grad.shape[1]).index_copy_(0, order, grad)
        return full.view(ctx.tokens, ctx.k, grad.shape[1]).sum(1), None, None


class LocalDispatcher:
    """Tokens to experts within one process (no expert parallelism)."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts

    def dispatch(self, x: Tensor, expert_idx: Tensor) -> tuple[Tensor, list[int], Any]:
        """x: (T, dim); expert_idx: (T, k), -1 for a dropped assignment. Returns the kept
        assignments' tokens sorted by expert (stable: token order within an expert), the count
        per expert (one host read) and the state ``combine`` needs."""
        t, k = expert_idx.shape
        flat = expert_idx.reshape(-1)
        key = torch.where(flat >= 0, flat, self.n_experts)  # dropped assignments sort last
        counts = torch.bincount(key, minlength=self.n_experts + 1)[: self.n_experts].tolist()
        order = torch.sort(key, stable=True).indices[: sum(counts)]
        return GatherTokens.apply(x, order, k), counts, _DispatchState(order, t * k)

    def combine(self, y: Tensor, state: Any) -> Tensor:
        """y: (N, dim) in dispatch order -> (T * k, dim) in assignment order (row t * k + j is token
        t's j-th choice), zero rows for dropped assignments. Every row is written once."""
        return y.new_zeros(state.assignments, y.shape[1]).index_copy(0, state.order, y)


# ------------------------------------------------------------------------------------------ the layer

class MoE(nn.Module):
    """Routed experts (top-k of ``n_experts``) plus optional shared experts; a drop-in for ``MLP``
    on x of shape (batch, seq, dim), where seq may be this rank's shard of the sequence."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        from .llama import MLP  # here, not at the top: llama imports this module for its Block

        self.n_experts, self.top_k = cfg.n_experts, cfg.moe_top_k
        self.router_score = cfg.router_score
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.aux_loss_level = cfg.aux_loss_coef, cfg.aux_loss_level
        self.bias_update_rate = cfg.bias_update_rate
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared: nn.Module | None = (MLP(cfg, hidden=cfg.n_shared_experts * cfg.expert_ffn_dim)
                                         if cfg.n_shared_experts > 0 else None)
        self.dispatcher: Any = LocalDispatcher(cfg.n_experts)
        self.reduce_seq_stats: Callable[[Tensor], Tensor] = identity
        self.reduce_batch_stats: Callable[[Tensor], Tensor] = identity
        self.step_info = MoEStepInfo()
        # the step's statistics: plain tensors, not buffers (a buffer would be broadcast, cast to the
        # compute dtype and checkpointed by the parallel wrappers); made on the input's device
        self.step_counts = torch.zeros(cfg.n_experts, dtype=torch.float64, device="cpu")
        self.step_dropped = torch.zeros((), dtype=torch.float64, device="cpu")
        self.step_aux = torch.zeros((), dtype=torch.float64, device="cpu")

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, S, dim) -> (B, S, dim) in x's dtype; every token routed."""
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        t = tokens.shape[0]
        route = self.router(tokens)
        chosen = route.expert_idx
        kept = chosen
        if math.isfinite(self.capacity_factor):
            kept = drop_over_capacity(chosen, self.n_experts,
                                      expert_capacity(t, self.top_k, self.n_experts, self.capacity_factor))
        routed, counts, state = self.dispatcher.dispatch(tokens, kept)
        y = self.dispatcher.combine(self.experts(routed, counts), state)
        out = (y.view(t, self.top_k, d) * route.weights.to(y.dtype).unsqueeze(-1)).sum(1)
        if self.shared is not None:
            out = out + self.shared(tokens)

        if torch.is_grad_enabled():  # training: balance (a recompute repeats the forward's ops exactly)
            chosen_counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
            aux = self._aux_loss(route.scores, chosen, chosen_counts, b) if self.aux_loss_coef > 0 else None
            if aux is not None:
                out = AuxLossInjector.apply(out, aux, self.step_info.shares * self.step_info.loss_scale)
            if not in_backward():  # a real forward, not activation checkpointing's recompute
                self._count(x.device, chosen_counts, kept if math.isfinite(self.capacity_factor) else None, aux)
        return out.view(b, s, d).to(x.dtype)

    def _aux_loss(self, scores: Tensor, chosen: Tensor, chosen_counts: Tensor, rows: int) -> Tensor:
        """This rank's part of the balance loss (the parts of all ranks sum to the loss)."""
        probs = balance_probs(scores, self.router_score)
        info = self.step_info
        if self.aux_loss_level == "sequence":
            global_rows = info.global_rows if info.global_rows is not None else rows
            return sequence_aux_loss(probs, chosen, rows, self.aux_loss_coef, global_rows, self.reduce_seq_stats)
        return batch_aux_loss(probs, chosen_counts, self.top_k, self.aux_loss_coef, info.microbatches,
                              self.reduce_batch_stats)

    def _count(self, device: torch.device, chosen_counts: Tensor, kept: Tensor | None, aux: Tensor | None) -> None:
        """Add this forward's expert choices, dropped assignments and auxiliary loss to the step's."""
        self._accumulators_on(device)
        self.step_counts += chosen_counts.to(torch.float64)
        if kept is not None:
            self.step_dropped += (kept < 0).sum().to(torch.float64)
        if aux is not None:
            self.step_aux += aux.detach().to(torch.float64)

    def _accumulators_on(self, device: torch.device) -> None:
        """Keep the step's statistics on ``device`` (made there if they were never filled)."""
        if self.step_counts.device == device:
            return
        if self.step_counts.is_meta:
            self.reset_step(device)
            return
        self.step_counts, self.step_dropped, self.step_aux = (
            v.to(device) for v in (self.step_counts, self.step_dropped, self.step_aux))

    def reset_step(self, device: torch.device | str | None = None) -> None:
        """Zero the step's statistics (on ``device``, default where they are)."""
        device = self.step_counts.device if device is None else device
        self.step_counts = torch.zeros(self.n_experts, dtype=torch.float64, device=device)
        self.step_dropped = torch.zeros((), dtype=torch.float64, device=device)
        self.step_aux = torch.zeros((), dtype=torch.float64, device=device)

    def step_row(self) -> Tensor:
        """[step_counts (E), step_dropped, step_aux] as one float64 row on the gate's device."""
        self._accumulators_on(self.router.gate.weight.device)
        return torch.cat([self.step_counts, self.step_dropped.view(1), self.step_aux.view(1)])

    @torch.no_grad()
    def update_bias(self, counts: Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: raise the bias of the experts chosen less than
        the mean, lower it for those chosen more, by ``bias_update_rate``."""
        bias = self.router.expert_bias
        step = torch.sign(counts.mean() - counts) * self.bias_update_rate
        bias.copy_((bias.to(torch.float64) + step.to(bias.device)).to(bias.dtype))


# --------------------------------------------------------------------------------- the model's layers

def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every ``MoE`` layer of ``model`` with its module name, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def set_moe_step(model: nn.Module, info: MoEStepInfo) -> None:
    """Give every MoE layer of ``model`` the step's layout (``MoEStepInfo``)."""
    for _, layer in moe_layers(model):
        layer.step_info = info


def finish_moe_step(model: nn.Module, reduce: Callable[[Tensor], Tensor] = identity) -> MoEStats | None:
    """Once per optimizer step, after the backwards and before ``optimizer.step()``: the step's
    statistics of every MoE layer as one float64 [layers, E + 2] tensor, summed by one ``reduce``
    call over the ranks that saw other tokens; then each layer's bias update (if
    ``bias_update_rate`` > 0) and its statistics zeroed. None when ``model`` has no MoE layer."""
    layers = moe_layers(model)
    if not layers:
        return None
    rows = reduce(torch.stack([layer.step_row() for _, layer in layers]))
    e = layers[0][1].n_experts
    counts, dropped, aux = rows[:, :e], rows[:, e], rows[:, e + 1]
    for (_, layer), layer_counts in zip(layers, counts):
        if layer.bias_update_rate > 0:
            layer.update_bias(layer_counts)
        layer.reset_step()
    return MoEStats(counts=counts, dropped=dropped, aux=aux, names=[name for name, _ in layers])


__all__ = ["MoE", "MoEStepInfo", "MoEStats", "GroupedExperts", "GatherTokens", "LocalDispatcher", "moe_layers", "set_moe_step",
           "finish_moe_step", "identity", "in_backward"]
