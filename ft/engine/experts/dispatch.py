"""Batched MoE dispatch: group the routed (token, expert) pairs by expert, with one host sync.

Legend: T = tokens, K = experts per token, D = hidden, I = expert intermediate, E = experts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertGroup:
    expert: int
    rows: torch.Tensor  # [n] token indices into x
    weights: torch.Tensor  # [n] routing weights of those tokens for this expert


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """The experts used by this batch, ascending, each with its tokens and weights."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # [T*K]
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order].tolist()  # the one host sync per layer (unique() would add one)
    tokens, weights = order // top_k, topk_weights.flatten()[order]
    groups, start = [], 0
    for expert, run in itertools.groupby(sorted_ids):
        count = sum(1 for _ in run)
        groups.append(
            ExpertGroup(expert, tokens[start : start + count], weights[start : start + count])
        )
        start += count
    return groups


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """down(silu(x @ gate.T) * (x @ up.T)); w13 [2I, D], w2 [D, I], x [n, D] -> [n, D]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)


def add_expert(out: torch.Tensor, x: torch.Tensor, group: ExpertGroup, w13, w2) -> None:
    """out[rows] += weights * FFN(x[rows]) for one expert."""
    y = expert_ffn(x[group.rows], w13, w2)  # [n, D]
    out.index_add_(0, group.rows, y * group.weights.to(y.dtype)[:, None])
