"""Routed experts of the latent MoE for many tokens (prefill): tokens sorted by expert, one batched GEMM per
projection over every expert at once (no loop over experts).

`grouped_experts(z, ids, weights, w1, w3, w2)`: the (token, slot) pairs are sorted by expert (stable), each
expert's pairs are packed into its own row range of a [E, capacity, latent] buffer (capacity = the busiest
expert's count, padding rows zero), and
    hidden = SiLU(Z_e W1_e^T) * (Z_e W3_e^T),   out_e = hidden W2_e^T       (torch.bmm over E, bf16)
run as three batched GEMMs; results are copied back to [N, k, latent] in the pairs' order and mixed with the
routing weights in fp32. The padding costs `E * capacity / (N * k) - 1` extra rows (small when routing is
balanced). One host synchronisation reads the capacity. Tokens go in chunks of TOKEN_CHUNK to bound the buffer.
`naive_grouped_experts`: one expert at a time over its gathered tokens (the reference MoE's order), fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOKEN_CHUNK = 16384


def _grouped_chunk(z: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    num_tokens, slots = ids.shape
    num_experts = w1.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair indices sorted by expert
    expert = flat[order]
    counts = torch.bincount(flat, minlength=num_experts)
    capacity = int(counts.max())
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(order.shape[0], device=z.device) - first[expert]
    packed_row = expert * capacity + slot  # each sorted pair's row in the packed buffer
    packed = z.new_zeros(num_experts * capacity, z.shape[1])
    packed.index_copy_(0, packed_row, z.index_select(0, order // slots))
    packed = packed.view(num_experts, capacity, -1)
    hidden = F.silu(torch.bmm(packed, w1.transpose(1, 2))) * torch.bmm(packed, w3.transpose(1, 2))
    out = torch.bmm(hidden, w2.transpose(1, 2))  # [E, capacity, latent]
    result = out.new_empty(flat.shape[0], out.shape[2])
    result.index_copy_(0, order, out.view(num_experts * capacity, -1).index_select(0, packed_row))
    return result.view(num_tokens, slots, -1)


def grouped_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """z [N, latent], ids [N, k] expert ids, weights [N, k] routing weights, w1/w3 [E, inter, latent],
    w2 [E, latent, inter] (same dtype as z) -> sum_j weights[:, j] * expert_{ids[:, j]}(z) [N, latent] fp32."""
    mixed = z.new_empty(z.shape[0], z.shape[1], dtype=torch.float32)
    for lo in range(0, z.shape[0], TOKEN_CHUNK):
        hi = min(lo + TOKEN_CHUNK, z.shape[0])
        out = _grouped_chunk(z[lo:hi], ids[lo:hi], w1, w3, w2)  # [n, k, latent]
        mixed[lo:hi] = torch.bmm(weights[lo:hi].float().unsqueeze(1), out.float()).squeeze(1)
    return mixed


def expert_pairs(z: torch.Tensor, local_ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """One expert output per (token, slot) pair: z [n, latent] (one row per pair), local_ids [n] into the experts
    of w1/w3/w2 -> [n, latent] in z's dtype (the grouped GEMMs of `grouped_experts` with one slot per row; the
    expert-parallel prefill runs the pairs a rank owns, engine/parallel/fast_prefill.py)."""
    out = z.new_empty(z.shape[0], w2.shape[1])
    chunk = TOKEN_CHUNK * 8  # pairs: the packed buffer of TOKEN_CHUNK tokens of 8 slots
    for lo in range(0, z.shape[0], chunk):
        hi = min(lo + chunk, z.shape[0])
        out[lo:hi] = _grouped_chunk(z[lo:hi], local_ids[lo:hi, None], w1, w3, w2)[:, 0]
    return out


def naive_grouped_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                          w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference: a loop over the experts used, each on its gathered tokens, in fp32, then the weighted sum."""
    z, w1, w3, w2 = z.float(), w1.float(), w3.float(), w2.float()
    out = z.new_zeros(ids.shape[0], ids.shape[1], z.shape[1])
    for e in torch.unique(ids).tolist():
        rows, cols = (ids == e).nonzero(as_tuple=True)
        hidden = F.silu(z[rows] @ w1[e].t()) * (z[rows] @ w3[e].t())
        out[rows, cols] = hidden @ w2[e].t()
    return (out * weights.float().unsqueeze(-1)).sum(1)
