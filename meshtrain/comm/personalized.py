"""Personalized collectives (each rank gets different data): gather, scatter, all_to_all; and barrier."""

from __future__ import annotations

from typing import Any

import torch

from . import runner
from .algorithms import implementation
from .algorithms.base import Ctx
from .transport.base import capabilities
from .call import call_meta, check_list, check_tensor, choose_algorithm, resolve_group
from .communicator import Group
from .types import check_dtype
from .work import Work


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``gather_list[i]`` on global rank ``dst`` receives rank i's ``tensor``."""
    g = resolve_group(group)
    check_dtype(check_tensor(tensor, g).dtype)
    root = g.check_root(dst, "dst")
    if g.rank == root:
        check_list(gather_list, g, tensor, "gather_list")
    nbytes = tensor.numel() * tensor.element_size() * g.size
    algo = choose_algorithm(g, "gather", algorithm, nbytes, tensor.dtype)
    run = implementation("gather", algo)

    def body(ctx: Ctx) -> Any:
        run(ctx, g, tensor, gather_list, root, dst)
        return gather_list

    return runner.run(g, "gather", call_meta([tensor.shape], tensor.dtype, algo, root=dst), body, async_op, nbytes)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``tensor`` on rank i receives ``scatter_list[i]`` of global rank ``src``."""
    g = resolve_group(group)
    check_dtype(check_tensor(tensor, g).dtype)
    root = g.check_root(src, "src")
    if g.rank == root:
        check_list(scatter_list, g, tensor, "scatter_list")
    nbytes = tensor.numel() * tensor.element_size() * g.size
    algo = choose_algorithm(g, "scatter", algorithm, nbytes, tensor.dtype)
    run = implementation("scatter", algo)

    def body(ctx: Ctx) -> torch.Tensor:
        run(ctx, g, tensor, scatter_list, root, src)
        return tensor

    return runner.run(g, "scatter", call_meta([tensor.shape], tensor.dtype, algo, root=src), body, async_op, nbytes)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``output_tensor_list[j]`` on rank i receives ``input_tensor_list[i]`` of rank j (sizes may differ)."""
    g = resolve_group(group)
    for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != g.size:
            raise ValueError(f"{name} must be a list of {g.size} tensors (the group size)")
        for i, t in enumerate(lst):
            check_dtype(check_tensor(t, g, f"{name}[{i}]").dtype)
    dtypes = {t.dtype for t in list(output_tensor_list) + list(input_tensor_list)}
    if len(dtypes) > 1:
        raise ValueError(f"all_to_all: every tensor must have one dtype, got {sorted(map(str, dtypes))}")
    dtype = input_tensor_list[0].dtype
    nbytes = sum(t.numel() * t.element_size() for t in input_tensor_list)
    algo = choose_algorithm(g, "all_to_all", algorithm, nbytes, dtype)
    run = implementation("all_to_all", algo)
    # Pairwise sizes are checked by the metadata exchange: rank i's send to j must equal j's recv from i.
    sends = [t.numel() for t in input_tensor_list]
    recvs = [t.numel() for t in output_tensor_list]

    def body(ctx: Ctx) -> list[torch.Tensor]:
        ins = [t.contiguous().view(-1) for t in input_tensor_list]
        outs = [torch.empty(t.numel(), dtype=t.dtype, device=t.device) for t in output_tensor_list]
        run(ctx, g, outs, ins)
        for o, t in zip(outs, output_tensor_list):
            t.copy_(o.view(t.shape))
        return output_tensor_list

    meta = call_meta([], dtype, algo)
    return runner.run(g, "all_to_all", meta, body, async_op, nbytes, pairwise=(sends, recvs))


def _splits(t: torch.Tensor, sizes: Any, p: int, name: str, what: str) -> list[torch.Tensor]:
    """``t`` cut along dim 0 into ``sizes`` (None: p equal parts) as views, so writes land in ``t``."""
    rows = t.shape[0] if t.dim() else 1
    if sizes is None or len(sizes) == 0:
        if rows % p:
            raise ValueError(f"all_to_all_single: {what} has {rows} rows (dim 0), which do not split into "
                             f"{p} equal parts (the group size): pad it or pass {name}")
        sizes = [rows // p] * p
    sizes = [int(s) for s in sizes]
    if len(sizes) != p:  # RuntimeError, as torch's
        raise RuntimeError(f"all_to_all_single: {name} has {len(sizes)} entries; it needs one per rank "
                           f"of the group ({p})")
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise RuntimeError(f"all_to_all_single: {name} {sizes} must be non-negative and add up to the "
                           f"{rows} rows (dim 0) of {what}")
    view = t if t.dim() else t.view(1)
    return list(view.split(sizes, dim=0))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Group | None = None,
                      async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """torch.distributed's all_to_all_single: rank i's ``input`` is cut along dim 0 into
    ``input_split_sizes`` (None: equal parts), part j goes to rank j, and ``output`` receives the
    parts of every rank in group order, cut by ``output_split_sizes``; in place in ``output``.
    Rank i's ``input_split_sizes[j]`` must equal rank j's ``output_split_sizes[i]`` (checked)."""
    g = resolve_group(group)
    check_tensor(output, g, "output")
    check_tensor(input, g, "input")
    if output.dtype != input.dtype:
        raise ValueError(f"all_to_all_single: output is {output.dtype} but input is {input.dtype}; "
                         "both must have one dtype")
    outs = _splits(output, output_split_sizes, g.size, "output_split_sizes", "output")
    ins = _splits(input, input_split_sizes, g.size, "input_split_sizes", "input")
    work = all_to_all(outs, ins, group=g, async_op=async_op, algorithm=algorithm)
    if work is None:
        return None
    # torch's future value is [output], not the list of parts
    wrapped = Work(work.description)
    work.add_done_callback(lambda w: wrapped._finish(output, w._exc))
    return wrapped


def barrier(group: Group | None = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Block until every rank of the group has called barrier (``device_ids``: accepted for
    torch.distributed's signature; meshtrain needs no device to synchronise)."""
    g = resolve_group(group)
    # torch's own barrier where the transport has one and no metadata exchange is wanted; else
    # the runner's forced metadata exchange is the barrier (the "direct" entry does nothing).
    native = capabilities(g.comm.transport).native_collectives and not g.comm.check
    algo = "native" if native else "direct"
    run = implementation("barrier", algo)
    return runner.run(g, "barrier", call_meta([], torch.float32, algo), lambda ctx: run(ctx, g), async_op, 0,
                      force_exchange=not native)
