"""Functional layers: forward(...) -> (out, cache) and backward(dout, cache) -> grads, in the input's dtype."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

# Python-float constants only: under NEP 50 they take the array's dtype, where an np.float64 would upcast float32.
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None):
    # x [..., in], w [in, out] (Conv1D layout), b [out] or None -> out [..., out]
    x2 = x.reshape(-1, x.shape[-1])  # [N, in]: one big GEMM instead of a batched one
    out = x2 @ w  # [N, out]
    if b is not None:
        out += b  # [N, out]
    return out.reshape(*x.shape[:-1], w.shape[1]), (x2, w, x.shape, b is not None)


def linear_backward(dout: np.ndarray, cache):
    # dout [..., out] -> dx [..., in], dw [in, out], db [out] (None without bias)
    x2, w, shape, has_bias = cache
    d2 = dout.reshape(-1, w.shape[1])  # [N, out]
    dx = (d2 @ w.T).reshape(shape)  # [N, in] -> [..., in]
    dw = x2.T @ d2  # [in, out]
    db = _ones(d2.shape[0], d2.dtype) @ d2 if has_bias else None  # [out]: a BLAS gemv, faster than sum(axis=0)
    return dx, dw, db


def embedding_forward(idx: np.ndarray, wte: np.ndarray, wpe: np.ndarray):
    # idx [B, T] int, wte [V, d], wpe [Tmax, d] -> token + position embedding [B, T, d]
    T = idx.shape[1]
    if T > wpe.shape[0]:
        raise ValueError(f"sequence length {T} exceeds the {wpe.shape[0]} learned positions")
    out = np.take(wte, idx, axis=0)  # [B, T, d]
    out += wpe[:T]  # [B, T, d] + [T, d]
    return out, (idx, wte.shape, wpe.shape)


def embedding_backward(dout: np.ndarray, cache):
    # dout [B, T, d] -> dwte [V, d], dwpe [Tmax, d]
    idx, wte_shape, wpe_shape = cache
    T, d = idx.shape[1], wte_shape[1]
    dwpe = np.zeros(wpe_shape, dtype=dout.dtype)  # [Tmax, d]: unused positions get zero
    dwpe[:T] = dout.sum(axis=0)  # [T, d]
    dwte = np.zeros(wte_shape, dtype=dout.dtype)  # [V, d]
    # Repeated tokens must accumulate: a flat 1-D np.add.at takes numpy's fast path (about 4x a 2-D
    # add.at), sums sequentially in index order (deterministic) and stays in the model dtype.
    flat = (idx.reshape(-1, 1) * d + np.arange(d)).reshape(-1)  # [B*T*d] element offsets into dwte
    np.add.at(dwte.reshape(-1), flat, dout.reshape(-1))  # [V*d] += [B*T*d]
    return dwte, dwpe


@lru_cache(maxsize=16)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    ones = np.ones(n, dtype=dtype)  # [n]
    ones.flags.writeable = False
    return ones


@lru_cache(maxsize=16)
def _mean_vec(d: int, dtype: np.dtype) -> np.ndarray:
    # [d] of 1/d: row means as one BLAS gemv (x2 @ vec), ~6x faster than x.mean(-1) on short rows
    vec = np.full(d, 1.0 / d, dtype=dtype)
    vec.flags.writeable = False
    return vec


def layernorm_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5):
    # x [..., d], w [d], b [d] -> out [..., d], normalised over the last axis
    d = x.shape[-1]
    avg = _mean_vec(d, x.dtype)  # [d]
    x2 = x.reshape(-1, d)  # [N, d]
    xhat = x2 - (x2 @ avg)[:, None]  # [N, d] centred
    var = (xhat * xhat) @ avg  # [N] biased variance, as torch
    rstd = 1.0 / np.sqrt(var + eps)  # [N]
    xhat *= rstd[:, None]  # [N, d]
    out = xhat * w  # [N, d]
    out += b  # [N, d]
    return out.reshape(x.shape), (xhat, rstd, w, x.shape)


def layernorm_backward(dout: np.ndarray, cache):
    # dout [..., d] -> dx [..., d], dw [d], db [d]
    xhat, rstd, w, shape = cache
    d = w.shape[0]
    avg = _mean_vec(d, dout.dtype)  # [d]
    d2 = dout.reshape(-1, d)  # [N, d]
    dw = np.einsum("nd,nd->d", d2, xhat)  # [d]: no [N, d] temporary
    db = d2.sum(axis=0)  # [d]
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), both means over the last axis
    dxhat = d2 * w  # [N, d]
    m2 = (dxhat * xhat) @ avg  # [N]
    dxhat -= (dxhat @ avg)[:, None]  # [N, d]
    dxhat -= xhat * m2[:, None]  # [N, d]
    dxhat *= rstd[:, None]  # [N, d]
    return dxhat.reshape(shape), dw, db


# GELU is a chain of ~8 elementwise passes over an [N, 4d] array. Run in chunks of this many elements
# (256 KiB of float32), the chain's temporaries stay in L2 between passes: ~25% faster than whole-array
# passes at the default size, and bitwise identical since every operation is elementwise.
_GELU_CHUNK = 1 << 16


def gelu_forward(x: np.ndarray):
    # x [...] -> x h with h = 0.5 (1 + tanh(c (x + a x^3))), GPT-2's "gelu_new"
    xf = np.ascontiguousarray(x).reshape(-1)  # [n] flat view
    x2, h, out = np.empty_like(xf), np.empty_like(xf), np.empty_like(xf)  # [n] each; x2 kept for backward
    for s in range(0, xf.size, _GELU_CHUNK):
        xs, x2s, hs = xf[s : s + _GELU_CHUNK], x2[s : s + _GELU_CHUNK], h[s : s + _GELU_CHUNK]  # [chunk] views
        np.multiply(xs, xs, out=x2s)  # x^2
        np.multiply(x2s, _GELU_A * _GELU_C, out=hs)
        hs += _GELU_C
        hs *= xs  # c (x + a x^3)
        np.tanh(hs, out=hs)  # t
        hs += 1.0
        hs *= 0.5  # h = 0.5 (1 + t)
        np.multiply(xs, hs, out=out[s : s + _GELU_CHUNK])  # x h
    return out.reshape(x.shape), (xf, x2, h, x.shape)


def gelu_backward(dout: np.ndarray, cache):
    # dout [...] -> dx [...]. With t = 2h - 1: d/dx = h + 0.5 x (1 - t^2) c (1 + 3 a x^2)
    #   = h (1 + 2 x (1 - h) (c + 3 a c x^2)), as 1 - t^2 = 4 h (1 - h)
    xf, x2, h, shape = cache
    df = np.ascontiguousarray(dout).reshape(-1)  # [n]
    g = np.empty_like(xf)  # [n]
    tmp = np.empty(min(_GELU_CHUNK, xf.size), dtype=xf.dtype)  # [chunk] scratch
    for s in range(0, xf.size, _GELU_CHUNK):
        gs, hs = g[s : s + _GELU_CHUNK], h[s : s + _GELU_CHUNK]  # [chunk] views
        t = tmp[: gs.size]
        np.multiply(x2[s : s + _GELU_CHUNK], 6.0 * _GELU_A * _GELU_C, out=gs)
        gs += 2.0 * _GELU_C
        gs *= xf[s : s + _GELU_CHUNK]  # 2 x (c + 3 a c x^2)
        np.subtract(1.0, hs, out=t)
        gs *= t  # times (1 - h)
        gs += 1.0
        gs *= hs
        gs *= df[s : s + _GELU_CHUNK]
    return g.reshape(shape)


def dropout_forward(x: np.ndarray, p: float, rng: np.random.Generator | None):
    # x [...] -> x * mask / (1 - p); identity (no draw, no copy) when p == 0 or rng is None (eval)
    if p == 0.0 or rng is None:
        return x, None
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    # Always draw float32 uniforms: cheaper, and float32/float64 models then get the same masks.
    keep = rng.random(x.shape, dtype=np.float32) >= p  # [...] bool
    mask = keep.astype(x.dtype)  # [...]
    mask *= 1.0 / (1.0 - p)  # inverted dropout: eval needs no rescale
    return x * mask, mask


def dropout_backward(dout: np.ndarray, cache):
    # dout [...] -> dx [...]
    return dout if cache is None else dout * cache


@lru_cache(maxsize=16)
def _causal_bias(T: int, n_head: int, dtype: np.dtype) -> np.ndarray:
    # [Tk, nh*Tq]: -inf where key j > query i (the future), else 0
    bias = np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1).T  # [Tk, Tq]
    full = np.ascontiguousarray(np.broadcast_to(bias[:, None, :], (T, n_head, T))).reshape(T, n_head * T)
    full.flags.writeable = False
    return full


# Attention probabilities live as [B, Tk, nh, Tq] (keys before heads and queries): the softmax over keys is
# then a reduction over axis 1 with contiguous nh*Tq-long runs, ~10x faster than .max(-1) over 64-long rows.
# matmul reads and writes each [Tk, Tq] slab of this layout through BLAS leading dimensions: no copies.


def attention_forward(qkv: np.ndarray, n_head: int, p: float = 0.0, rng: np.random.Generator | None = None):
    # qkv [B, T, 3d] (c_attn output: q | k | v, heads contiguous inside each) -> causal MHA out [B, T, d]
    B, T, C3 = qkv.shape
    d = C3 // 3
    hs = d // n_head
    heads = qkv.reshape(B, T, 3, n_head, hs)  # [B, T, 3, nh, hs] view
    # Strided views: each [T, hs] slab has unit column stride, so matmul hands them to BLAS without copies.
    k = heads[:, :, 1].transpose(0, 2, 1, 3)  # [B, nh, T, hs]
    v = heads[:, :, 2].transpose(0, 2, 1, 3)  # [B, nh, T, hs]
    scale = 1.0 / math.sqrt(hs)  # python float: stays in the array dtype
    qs = heads[:, :, 0].transpose(0, 2, 1, 3) * scale  # [B, nh, T, hs]; scaling q is 4x cheaper than scores
    att = np.empty((B, T, n_head, T), dtype=qkv.dtype)  # [B, Tk, nh, Tq]
    np.matmul(k, qs.transpose(0, 1, 3, 2), out=att.transpose(0, 2, 1, 3))  # [B, nh, Tk, Tq] k.q/sqrt(hs)
    a3 = att.reshape(B, T, n_head * T)  # [B, Tk, nh*Tq] view
    a3 += _causal_bias(T, n_head, att.dtype)  # [B, Tk, nh*Tq] future keys -> -inf
    a3 -= a3.max(axis=1, keepdims=True)  # [B, Tk, nh*Tq]; key j = i is never masked: every max is finite
    np.exp(a3, out=a3)  # [B, Tk, nh*Tq]
    a3 /= a3.sum(axis=1, keepdims=True)  # [B, Tk, nh*Tq] softmax over keys
    att_d, dcache = dropout_forward(att, p, rng)  # [B, Tk, nh, Tq]
    y = np.matmul(att_d.transpose(0, 2, 3, 1), v)  # [B, nh, Tq, Tk] @ [B, nh, Tk, hs] -> [B, nh, Tq, hs]
    out = y.transpose(0, 2, 1, 3).reshape(B, T, d)  # [B, T, d] heads merged (copy)
    return out, (qs, k, v, att, att_d, dcache, out, n_head, scale)


def attention_backward(dout: np.ndarray, cache):
    # dout [B, T, d] -> dqkv [B, T, 3d]
    qs, k, v, att, att_d, dcache, out, n_head, scale = cache
    B, T, d = dout.shape
    hs = d // n_head
    dy = dout.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # [B, nh, Tq, hs] view
    dqkv = np.empty((B, T, 3, n_head, hs), dtype=dout.dtype)  # [B, T, 3, nh, hs]
    # matmul writes straight into the strided q/k/v slots of dqkv: no merge copy afterwards.
    np.matmul(att_d.transpose(0, 2, 1, 3), dy, out=dqkv[:, :, 2].transpose(0, 2, 1, 3))  # dv [B, nh, Tk, hs]
    datt = np.empty((B, T, n_head, T), dtype=dout.dtype)  # [B, Tk, nh, Tq]
    np.matmul(v, dy.transpose(0, 1, 3, 2), out=datt.transpose(0, 2, 1, 3))  # [B, nh, Tk, Tq] grad wrt att_d
    datt = dropout_backward(datt, dcache)  # [B, Tk, nh, Tq] grad wrt the softmax output
    # Softmax backward needs sum_j datt_ij att_ij = dy_i . y_i (FlashAttention's D): computed on [T, hs],
    # 4x smaller than [T, T], and it holds with dropout too since y = (att * mask) @ v.
    rows = np.einsum("bthe,bthe->bht", dout.reshape(B, T, n_head, hs), out.reshape(B, T, n_head, hs))  # [B, nh, Tq]
    d3 = datt.reshape(B, T, n_head * T)  # [B, Tk, nh*Tq]
    d3 -= rows.reshape(B, 1, n_head * T)  # [B, Tk, nh*Tq]
    d3 *= att.reshape(B, T, n_head * T)  # [B, Tk, nh*Tq] grad wrt the scaled scores; 0 where masked
    np.matmul(datt.transpose(0, 2, 3, 1), k, out=dqkv[:, :, 0].transpose(0, 2, 1, 3))  # d(qs) [B, nh, Tq, hs]
    dqkv[:, :, 0] *= scale  # [B, T, nh, hs] dq = d(qs) * scale
    np.matmul(datt.transpose(0, 2, 1, 3), qs, out=dqkv[:, :, 1].transpose(0, 2, 1, 3))  # dk [B, nh, Tk, hs]
    return dqkv.reshape(B, T, 3 * d)
