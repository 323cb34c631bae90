"""Kimi Delta Attention (KDA): projections, short conv, and the recurrent and chunked cores.

The engine runs the recurrent step for decode and, token by token, for prefill (`kda_sequential`: prefill and
decode agree bit for bit; on CUDA both run one Triton kernel, kda_cuda.py); the chunked form computes the same
values in a parallel order (the shape GPU kernels use) and is tested against the naive reference.

Per layer, H heads of d = d_k = d_v, gates per channel:
    q, k, v  = SiLU(causal depthwise conv over time (width W) of W_qkv x)     conv state: last W-1 inputs
    q, k     = l2-normalised per head; q *= d^-1/2
    g_t      = lb * sigmoid(exp(A_log_h) * (W_fb W_fa x + dt_bias))   (log decay, in (lb, 0));  beta = sigmoid(W_b x)
               (kda_gate "softplus", Kimi-Linear: g_t = -exp(A_log_h) * softplus(W_fb W_fa x + dt_bias), in (-inf, 0))
    S_t      = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T ;   o_t = S_t^T q_t
    out      = W_O( RMSNorm_d(o) * sigmoid(W_g x) )
State per request and layer: S [H, d_k, d_v] fp32 and conv [W-1, 3*H*d] (channels ordered q | k | v, head-major
inside each). The core functions work on any subset of heads (they never mix heads), so TP can shard heads.

Chunked form (chunk C=64 anchored at the first prefill token; zero padding at the end is exact because beta=0 and
g=0 leave the state untouched). Pairwise decays exp(G_i - G_j) are never formed from exp(G) * exp(-G) over a whole
chunk (G reaches -320 there): they are factored through the start r of the query's 8-token sub-chunk,
exp(G_i - G_r) * exp(G_r - G_j), whose exponents stay within +-40 for gates >= MIN_GATE (K3's lb = -5 qualifies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.model.config import ModelConfig
from engine.model.kda_cuda import kda_recurrence
from engine.model.numerics import RowLinear, rms_norm
from engine.model.shards import WHOLE, ShardSpec

SUB_CHUNK = 8
CHUNK_GROUP = 16
LOG_DECAY_CLAMP = 40.0
MIN_GATE = -LOG_DECAY_CLAMP / (SUB_CHUNK - 1)


@dataclass
class KDAProjection:
    """Token-wise outputs of the KDA input projections for R (padded) rows."""

    qkv: torch.Tensor  # [R, 3*H*d] before the conv
    gate_out: torch.Tensor  # [R, H*d]
    g: torch.Tensor  # [R, H, d] log decay
    beta: torch.Tensor  # [R, H]


class KDA(nn.Module):
    """One KDA layer. Built with a `ShardSpec` of W ranks it holds heads [head_lo, head_lo + num_heads) of w_qkv,
    the conv taps, w_g and w_fb, and d_model/W output rows of wo (engine/model/shards.py); w_fa, w_b, A_log and
    dt_bias stay whole (`project` slices the local heads out of their results). `num_heads` counts local heads."""

    def __init__(self, cfg: ModelConfig, shard: ShardSpec = WHOLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_lo, head_hi = shard.split(cfg.kda_num_heads, "KDA heads")
        out_lo, out_hi = shard.split(cfg.d_model, "output rows (d_model)")
        h, d = head_hi - self.head_lo, cfg.kda_head_dim
        self.num_heads, self.head_dim = h, d
        self.w_qkv = RowLinear(cfg.d_model, 3 * h * d)
        self.w_g = RowLinear(cfg.d_model, h * d)
        self.w_fa = RowLinear(cfg.d_model, d)
        self.w_fb = RowLinear(d, h * d)
        self.w_b = RowLinear(cfg.d_model, cfg.kda_num_heads)
        self.conv_weight = nn.Parameter(torch.empty(3 * h * d, cfg.kda_conv_size), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(cfg.kda_num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.kda_num_heads * d), requires_grad=False)
        self.o_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.wo = RowLinear(cfg.kda_num_heads * d, out_hi - out_lo)

    @property
    def is_whole(self) -> bool:
        return self.num_heads == self.cfg.kda_num_heads

    def project(self, x: torch.Tensor) -> KDAProjection:
        num_rows = x.shape[0]
        h, d = self.num_heads, self.head_dim
        raw = self.w_fb(self.w_fa(x))
        rate = torch.exp(self.A_log).repeat_interleave(d)
        dt_bias = self.dt_bias
        beta = torch.sigmoid(self.w_b(x))
        if not self.is_whole:  # whole-tensor kernels, then this rank's heads
            lo, hi = self.head_lo, self.head_lo + h
            rate, dt_bias, beta = rate[lo * d:hi * d], dt_bias[lo * d:hi * d], beta[:, lo:hi].contiguous()
        if self.cfg.kda_gate == "softplus":
            g = -rate * F.softplus(raw + dt_bias)
        else:
            g = self.cfg.kda_gate_lower_bound * torch.sigmoid(rate * (raw + dt_bias))
        return KDAProjection(
            qkv=self.w_qkv(x),
            gate_out=self.w_g(x),
            g=g.view(num_rows, h, d),
            beta=beta,
        )

    def split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, 3*H*d] after the conv -> normalised q (scaled), k and v, each [T, H, d]."""
        h, d = self.num_heads, self.head_dim
        q, k, v = conv_out.view(-1, 3, h, d).unbind(1)
        q = l2_normalize(q) * d**-0.5
        return q, l2_normalize(k), v

    def head_output(self, o: torch.Tensor, gate_out: torch.Tensor) -> torch.Tensor:
        """o [R, H, d] (the local heads) -> [R, H * d]: per-head RMSNorm, then the sigmoid output gate."""
        normed = rms_norm(o, self.o_norm, self.cfg.rms_eps).reshape(o.shape[0], -1)
        return normed * torch.sigmoid(gate_out)

    def output(self, o: torch.Tensor, gate_out: torch.Tensor) -> torch.Tensor:
        """o [R, H, d] -> [R, d_model] (a whole layer)."""
        return self.wo(self.head_output(o, gate_out))


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [T, C], state [W-1, C] (previous inputs), weight [C, W] -> (y [T,C], state).

    Terms are added in a fixed order (oldest first), so the decode step computes exactly what prefill computes.
    """
    taps = weight.t().contiguous()  # [W, C]
    padded = torch.cat([state, x], dim=0)  # [T + W - 1, C]
    num_tokens = x.shape[0]
    acc = padded[0:num_tokens] * taps[0]
    for w in range(1, taps.shape[0]):
        acc.add_(padded[w : w + num_tokens] * taps[w])
    return F.silu(acc), padded[num_tokens:].clone()


def causal_conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched one-token conv. x [B, C], state [B, W-1, C] -> (y [B, C], new state [B, W-1, C])."""
    taps = weight.t().contiguous()  # [W, C]
    window = torch.cat([state, x.unsqueeze(1)], dim=1)  # [B, W, C]
    acc = window[:, 0] * taps[0]
    for w in range(1, taps.shape[0]):
        acc.add_(window[:, w] * taps[w])
    return F.silu(acc), window[:, 1:].clone()


def kda_recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for B requests. q,k,v,g [B,H,d], beta [B,H], state [B,H,d_k,d_v] -> (o [B,H,d], state).
    On CUDA tensors: the Triton recurrence (kda_cuda.py), the same kernel `kda_sequential` runs there."""
    if q.is_cuda:
        o, s = kda_recurrence(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1),
                              state)
        return o[:, 0], s
    s = state * torch.exp(g).unsqueeze(-1)
    ks = (k.unsqueeze(-1) * s).sum(-2)  # S^T k  [B, H, d_v]
    u = beta.unsqueeze(-1) * (v - ks)
    s = s + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (q.unsqueeze(-1) * s).sum(-2), s


def kda_sequential(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over one request's T prompt tokens as T decode steps (`kda_recurrent_step`, a batch of one). Shapes as
    kda_chunked. What the engine's prefill runs: every output and the final state are bit-identical to decoding
    the same tokens one at a time, so a prompt's log-probs under teacher forcing equal, bit for bit, the log-probs
    served while decoding those tokens (the chunked form computes the same values in another order; it differs
    in the last bits). Costs ~1.6x the chunked form's time on one CPU core at 4K tokens. On CUDA tensors: one
    Triton kernel walks the tokens (kda_cuda.py), the same one the decode step runs there."""
    if q.is_cuda:
        o, s = kda_recurrence(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                              state.unsqueeze(0))
        return o[0], s[0]
    s = state.unsqueeze(0)
    outputs = []
    for t in range(q.shape[0]):
        o, s = kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outputs.append(o)
    return torch.cat(outputs, 0), s[0]


def _exp_decay(x: torch.Tensor) -> torch.Tensor:
    """exp of a log decay clamped to [-LOG_DECAY_CLAMP, LOG_DECAY_CLAMP]. Keeps every factor and every product of
    two factors a normal fp32 number (denormals are ~100x slower on x86); it changes a decay only where the true
    value is below e^-40 (4e-18)."""
    return torch.exp(x.clamp(-LOG_DECAY_CLAMP, LOG_DECAY_CLAMP))


def _pairwise(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Within each chunk: A_ij = sum_c k_ic k_jc e^(G_ic - G_jc) for j < i and P_ij (q_i instead of k_i), j <= i.

    q, k, cum [N, H, C, d] -> (A, P) each [N, H, C, C]. For a row i in sub-chunk s with start r, the decay is
    factored through r: e^(G_i - G_r) <= 1 times e^(G_r - G_j), which is <= 1 for j < r and at most
    e^(|g_min| * (SUB_CHUNK - 1)) < e^40 for j inside the sub-chunk, so each row block is one matmul.
    """
    n, h, c, d = k.shape
    ns = c // SUB_CHUNK
    ref = cum[:, :, ::SUB_CHUNK]  # [N, H, ns, d]: G at each sub-chunk start r
    to_ref = _exp_decay(cum - ref.repeat_interleave(SUB_CHUNK, dim=2))  # e^(G_i - G_r)
    reach = torch.arange(c).view(1, c) < (torch.arange(1, ns + 1) * SUB_CHUNK).view(ns, 1)  # [ns, C]: j < r + S
    k_ref = k.unsqueeze(2) * _exp_decay(ref.unsqueeze(3) - cum.unsqueeze(2))  # [N, H, ns, C, d]
    k_ref_t = k_ref.masked_fill(~reach.view(1, 1, ns, c, 1), 0.0).transpose(-1, -2)
    i_c = torch.arange(c)
    lower = i_c.view(-1, 1) > i_c.view(1, -1)
    a_kk = torch.matmul((k * to_ref).view(n, h, ns, SUB_CHUNK, d), k_ref_t).reshape(n, h, c, c) * lower
    p_qk = torch.matmul((q * to_ref).view(n, h, ns, SUB_CHUNK, d), k_ref_t).reshape(n, h, c, c)
    return a_kk, p_qk * (lower | torch.eye(c, dtype=torch.bool))


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over one request's T tokens. q,k,v,g [T,H,d], beta [T,H], state [H,d_k,d_v] -> (o [T,H,d], state)."""
    num_tokens, h, d = q.shape
    assert float(g.min()) >= MIN_GATE if g.numel() else True, f"chunked KDA needs log decays >= {MIN_GATE}"
    pad = (-num_tokens) % chunk_size
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = q.shape[0] // chunk_size
    # [N, H, C, d] / [N, H, C]
    q, k, v, g = (t.view(n, chunk_size, h, d).transpose(1, 2).contiguous() for t in (q, k, v, g))
    beta = beta.view(n, chunk_size, h).transpose(1, 2).contiguous()
    outputs = []
    s = state
    for lo in range(0, n, CHUNK_GROUP):
        hi = min(lo + CHUNK_GROUP, n)
        o, s = _chunk_group(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s)
        outputs.append(o)
    o = torch.cat(outputs, 0).transpose(1, 2).reshape(n * chunk_size, h, d)
    return o[:num_tokens], s


def _chunk_group(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """Intra-chunk work for a group of chunks at once, then the sequential state pass over them."""
    n, h, c, d = q.shape
    cum = torch.cumsum(g, dim=2)
    a, p = _pairwise(q, k, cum)
    a = a * beta.unsqueeze(-1)
    eye = torch.eye(c).expand(n, h, c, c)
    t_mat = torch.linalg.solve_triangular(eye + a, torch.diag_embed(beta), upper=False, unitriangular=True)
    w = torch.matmul(t_mat, k * _exp_decay(cum))
    u = torch.matmul(t_mat, v)
    last = cum[:, :, -1:]  # [N, H, 1, d]
    q_dec = q * _exp_decay(cum)
    k_dec = k * _exp_decay(last - cum)
    last_dec = _exp_decay(last).transpose(-1, -2)  # [N, H, d, 1]
    outs = []
    s = state
    for i in range(n):
        v_new = u[i] - torch.matmul(w[i], s)
        outs.append(torch.matmul(q_dec[i], s) + torch.matmul(p[i], v_new))
        s = last_dec[i] * s + torch.matmul(k_dec[i].transpose(-1, -2), v_new)
    return torch.stack(outs, 0), s


def naive_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: token-by-token delta rule in float64. Shapes as kda_chunked."""
    s = state.double().clone()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        for hh in range(q.shape[1]):
            kt, vt, qt = k[t, hh].double(), v[t, hh].double(), q[t, hh].double()
            sh = torch.diag(torch.exp(g[t, hh].double())) @ s[hh]
            sh = sh + beta[t, hh].double() * torch.outer(kt, vt - sh.t() @ kt)
            s[hh] = sh
            out[t, hh] = sh.t() @ qt
    return out.to(torch.float32), s.to(torch.float32)
