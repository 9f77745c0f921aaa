"""Fused projection weights: one GEMM for a layer's q, k and v projections and one for its
MLP's gate and up projections, instead of three and two.

A decode step multiplies a few rows by each weight matrix, so its GEMMs are short and each
call's fixed cost (dispatch, threading, packing) weighs; fused, a layer makes 4 GEMM calls
instead of 7 and reads the same bytes. The fused matrix is built once by concatenating the
rows of the separate ones, and the transformers modules' weights are then rebound as views
into it, so there is one copy in memory and the model's own forward (the reference the
tests compare against) reads the very same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FUSED_ATTR = "_tandem_fused"  # on the first module of a group: the fused matrix


@dataclass(frozen=True)
class FusedLayer:
    qkv: torch.Tensor  # [q_out + 2 * kv_out, hidden]
    qkv_sizes: tuple[int, int, int]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    intermediate: int


def fuse_rows(linears: list[Any]) -> torch.Tensor:
    """One matrix holding the linears' weights row after row, the linears' own weights
    rebound as views into it. Idempotent: a group fused before is returned as it is."""
    first = linears[0]
    fused: torch.Tensor | None = getattr(first, FUSED_ATTR, None)
    if fused is not None and all(
        lin.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        for lin in linears
    ):
        return fused
    fused = torch.cat([lin.weight.detach() for lin in linears])
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    setattr(first, FUSED_ATTR, fused)
    return fused


def fuse_layer(layer: Any) -> FusedLayer | None:
    """The layer's fused weights; None if a projection has a bias (left unfused)."""
    attn, mlp = layer.self_attn, layer.mlp
    group = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    if any(lin.bias is not None for lin in group):
        return None
    sizes = (
        int(attn.q_proj.weight.shape[0]),
        int(attn.k_proj.weight.shape[0]),
        int(attn.v_proj.weight.shape[0]),
    )
    qkv = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = fuse_rows([mlp.gate_proj, mlp.up_proj])
    return FusedLayer(qkv, sizes, gate_up, int(mlp.gate_proj.weight.shape[0]))
