"""Functional layers: forward(...) -> (out, cache) and backward(dout, cache) -> grads, in the input's dtype."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None):
    # x [..., in], w [in, out] (Conv1D layout), b [out] or None -> out [..., out]
    x2 = x.reshape(-1, x.shape[-1])  # [N, in]: one big GEMM instead of a batched one
    out = x2 @ w  # [N, out]
    if b is not None:
        out += b  # [N, out]
    return out.reshape(*x.shape[:-1], w.shape[1]), (x2, w, x.shape, b is not None)


def linear_backward(dout: np.ndarray, cache):
    # dout [..., out] -> dx [..., in], dw [in, out], db [out] (a BLAS gemv, faster than a sum; None without bias)
    x2, w, shape, has_bias = cache
    d2 = dout.reshape(-1, w.shape[1])  # [N, out]
    db = _filled(d2.shape[0], 1.0, d2.dtype) @ d2 if has_bias else None
    return (d2 @ w.T).reshape(shape), x2.T @ d2, db


def head_forward(x: np.ndarray, w: np.ndarray):
    # x [..., d], w [V, d] (the tied token embedding) -> logits [N, V] = x w^T, no bias
    x2 = x.reshape(-1, w.shape[1])  # [N, d]
    return x2 @ w.T, (x2, w)


def head_backward(dlogits: np.ndarray, cache, row_scale: np.ndarray):
    # dlogits [N, V] times row_scale [N] per row -> dx [N, d], dw [V, d] (the head's share of the tied weight's
    # gradient). The row scale is applied to the [N, d] operands, 8x fewer elements than dlogits.
    x2, w = cache
    dx = dlogits @ w  # [N, d]
    dx *= row_scale[:, None]
    return dx, dlogits.T @ (x2 * row_scale[:, None])


def embedding_forward(idx: np.ndarray, wte: np.ndarray, wpe: np.ndarray):
    # idx [B, T] int, wte [V, d], wpe [Tmax, d] -> token + position embedding [B, T, d]
    if wpe.shape[0] < (T := idx.shape[1]):
        raise ValueError(f"sequence length {T} exceeds the {wpe.shape[0]} learned positions")
    out = np.take(wte, idx, axis=0)  # [B, T, d]
    out += wpe[:T]  # [B, T, d] + [T, d]
    return out, (idx, wte.shape, wpe.shape)


def embedding_backward(dout: np.ndarray, cache):
    # dout [B, T, d] -> dwte [V, d], dwpe [Tmax, d] (zero at unused positions)
    idx, wte_shape, wpe_shape = cache
    T, d = idx.shape[1], wte_shape[1]
    dwte, dwpe = np.zeros(wte_shape, dtype=dout.dtype), np.zeros(wpe_shape, dtype=dout.dtype)
    dwpe[:T] = dout.sum(axis=0)  # [T, d]
    # Repeated tokens must accumulate: a flat 1-D np.add.at takes numpy's fast path (about 4x a 2-D
    # add.at), sums sequentially in index order (deterministic) and stays in the model dtype.
    flat = (idx.reshape(-1, 1) * d + np.arange(d)).reshape(-1)  # [B*T*d] element offsets into dwte
    np.add.at(dwte.reshape(-1), flat, dout.reshape(-1))  # [V*d] += [B*T*d]
    return dwte, dwpe


@lru_cache(maxsize=32)
def _filled(n: int, value: float, dtype: np.dtype) -> np.ndarray:
    # [n] read-only: sums (value 1) and row means (1/n) as one BLAS gemv, ~6x faster than x.mean(-1) on short rows
    vec = np.full(n, value, dtype=dtype)
    vec.flags.writeable = False
    return vec


def _normalize(x2: np.ndarray, eps: float):
    # x2 [N, d] -> xhat [N, d] (zero mean, unit biased variance per row, as torch), rstd [N]
    xhat = x2 - (x2 @ _filled(x2.shape[1], 1.0 / x2.shape[1], x2.dtype))[:, None]  # [N, d] centred
    var = np.einsum("nd,nd->n", xhat, xhat) / x2.shape[1]  # [N] no [N, d] temporary
    rstd = 1.0 / np.sqrt(var + eps)  # [N]
    xhat *= rstd[:, None]  # [N, d]
    return xhat, rstd


def _normalize_backward(dxhat: np.ndarray, xhat: np.ndarray, rstd: np.ndarray) -> np.ndarray:
    # dxhat [N, d] (overwritten) -> dx [N, d] = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), row means
    m2 = np.einsum("nd,nd->n", dxhat, xhat) / xhat.shape[1]  # [N]
    dxhat -= (dxhat @ _filled(xhat.shape[1], 1.0 / xhat.shape[1], xhat.dtype))[:, None]  # [N, d]
    dxhat -= xhat * m2[:, None]  # [N, d]
    dxhat *= rstd[:, None]  # [N, d]
    return dxhat


def layernorm_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float = 1e-5):
    # x [..., d], w [d], b [d] or None -> out [..., d], normalised over the last axis
    xhat, rstd = _normalize(x.reshape(-1, x.shape[-1]), eps)  # [N, d], [N]
    out = xhat * w  # [N, d]
    if b is not None:
        out += b  # [N, d]
    return out.reshape(x.shape), (xhat, rstd, w, x.shape, b is not None)


def layernorm_backward(dout: np.ndarray, cache):
    # dout [..., d] -> dx [..., d], dw [d], db [d] (None without bias)
    xhat, rstd, w, shape, has_bias = cache
    d2 = dout.reshape(-1, w.shape[0])  # [N, d]
    dw = np.einsum("nd,nd->d", d2, xhat)  # [d]: no [N, d] temporary
    db = _filled(d2.shape[0], 1.0, d2.dtype) @ d2 if has_bias else None  # [d] as a gemv
    return _normalize_backward(d2 * w, xhat, rstd).reshape(shape), dw, db


# LayerNorm then a linear layer, the norm's affine folded into the linear's: (xhat * g + beta) @ w + b =
# xhat @ (g[:, None] * w) + (beta @ w + b); its [N, d] passes (forward and backward) become [d, out] work.
def layernorm_linear_forward(x: np.ndarray, g: np.ndarray, beta: np.ndarray | None, w: np.ndarray,
                             b: np.ndarray | None, eps: float = 1e-5):  # fmt: skip
    # x [..., d], g [d], beta [d] (the norm's), w [d, out], b [out] (the linear's; both biases or neither) -> [..., out]
    xhat, rstd = _normalize(x.reshape(-1, x.shape[-1]), eps)  # [N, d], [N]
    wf = g[:, None] * w  # [d, out] folded weight
    out = xhat @ wf  # [N, out]
    if beta is not None:
        out += beta @ w + b  # [N, out] + [out] folded bias
    return out.reshape(*x.shape[:-1], w.shape[1]), (xhat, rstd, g, beta, w, wf, x.shape)


def layernorm_linear_backward(dout: np.ndarray, cache):
    # dout [..., out] -> dx [..., d], dg [d], dbeta [d], dw [d, out], db [out] (dbeta, db None without bias)
    xhat, rstd, g, beta, w, wf, shape = cache
    d2 = dout.reshape(-1, w.shape[1])  # [N, out]
    dwf = xhat.T @ d2  # [d, out] grad wrt the folded weight
    dw = g[:, None] * dwf  # [d, out] through wf = g w
    db = dbeta = None
    if beta is not None:
        db = _filled(d2.shape[0], 1.0, d2.dtype) @ d2  # [out] = the linear's db (the folded bias)
        dw += beta[:, None] * db  # [d, out] through beta @ w
        dbeta = w @ db  # [d]
    dg = np.einsum("io,io->i", dwf, w)  # [d]
    return _normalize_backward(d2 @ wf.T, xhat, rstd).reshape(shape), dg, dbeta, dw, db


# GELU is ~15 elementwise passes over [N, 4d]: in chunks of this many elements their temporaries stay in L2
# (~25% faster than whole-array passes, the same bits: every operation is elementwise).
_GELU_CHUNK = 1 << 16


def gelu_forward(x: np.ndarray, erf: bool = False):
    # x [...] -> x h, h = 0.5 (1 + tanh(u)), u = c (x + a x^3): GPT-2's "gelu_new", as h = 1 / (1 + exp(z)),
    # z = -2u (one exp costs half a tanh). The cache is the derivative, so the backward is one multiply:
    #   d(x h)/dx = h + x dh/dx = h - x h (1 - h) z',  z' = dz/dx = -2c (1 + 3 a x^2)
    # erf=True: x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2 = erfc(-x / sqrt 2) / 2, the exact GELU (torch's
    # default, nanoGPT's); scipy's erfc (a ufunc numpy lacks) is imported only by a model that asks for it.
    if erf:
        from scipy.special import erfc
    c, a = math.sqrt(2.0 / math.pi), 0.044715  # Python floats: NEP 50 keeps the array's dtype
    xf = np.ascontiguousarray(x).reshape(-1)  # [n] flat view
    out, grad = np.empty_like(xf), np.empty_like(xf)  # [n] each
    s1, s2, s3 = (np.empty(min(_GELU_CHUNK, xf.size), xf.dtype) for _ in range(3))  # scratch
    # x < ~-5 (float32): e = inf, h = 0, out = -0 and grad = 0, as the limit
    with np.errstate(over="ignore"):
        for s in range(0, xf.size, _GELU_CHUNK):
            piece = slice(s, s + _GELU_CHUNK)
            xs, o, g = xf[piece], out[piece], grad[piece]  # [chunk] views
            x2, z, h = s1[: xs.size], s2[: xs.size], s3[: xs.size]
            if erf:  # g is phi, then the derivative; h is Phi
                np.multiply(xs, xs, out=g)  # x^2
                g *= -0.5
                np.exp(g, out=g)
                g *= 1.0 / math.sqrt(2.0 * math.pi)  # phi(x)
                np.multiply(xs, -1.0 / math.sqrt(2.0), out=h)
                erfc(h, out=h)  # 1 + erf(x / sqrt 2) without its cancellation for x < 0
                h *= 0.5  # Phi(x)
                np.multiply(xs, h, out=o)
                g *= xs
                g += h  # Phi(x) + x phi(x)
                continue
            np.multiply(xs, xs, out=x2)  # x^2
            np.multiply(x2, -2.0 * a * c, out=z)
            z += -2.0 * c
            z *= xs  # z = -2u
            np.exp(z, out=h)  # e
            h += 1.0
            # h = 1 / (1 + e): the same bits as np.reciprocal, at about half its time
            np.divide(1.0, h, out=h)
            np.multiply(xs, h, out=o)  # x h
            np.multiply(x2, -6.0 * a * c, out=z)
            z += -2.0 * c  # z'
            np.subtract(1.0, h, out=x2)  # 1 - h
            x2 *= o
            x2 *= z  # x h (1 - h) z'
            np.subtract(h, x2, out=g)
    return out.reshape(x.shape), grad.reshape(x.shape)


def dropout_forward(x: np.ndarray, p: float, rng: np.random.Generator | None):
    # x [...] -> x * mask / (1 - p); identity (no draw, no copy) when p == 0 or rng is None (eval)
    if p == 0.0 or rng is None:
        return x, None
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    # Always draw float32 uniforms: cheaper, and float32/float64 models then get the same masks.
    keep = rng.random(x.shape, dtype=np.float32) >= p  # [...] bool
    mask = np.multiply(keep, x.dtype.type(1.0 / (1.0 - p)))  # [...] 0 or 1/(1-p): inverted dropout
    return x * mask, mask


def dropout_backward(dout: np.ndarray, cache):
    # dout [...] -> dx [...]: times the factor the forward cached (the mask; GELU's derivative), if any
    return dout if cache is None else dout * cache


gelu_backward = dropout_backward  # dout [...] -> dx [...] = dout * gelu'(x)


@lru_cache(maxsize=16)
def _causal_bias(T: int, n_head: int, dtype: np.dtype) -> np.ndarray:
    # [Tk, nh*Tq]: -inf where key j > query i (the future), else 0
    bias = np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1).T  # [Tk, Tq]
    full = np.ascontiguousarray(np.broadcast_to(bias[:, None, :], (T, n_head, T))).reshape(T, -1)
    full.flags.writeable = False
    return full


# Attention probabilities live as [B, Tk, nh, Tq]: the softmax over keys reduces axis 1 over contiguous
# nh*Tq-long runs (~10x faster than over 64-long rows); matmul reads and writes each [Tk, Tq] slab through BLAS
# leading dimensions, no copies. Queries go in blocks of _QBLOCK, each over the keys it may see (62% of the
# T x T work at T=256): a skipped term was an exact zero at a dot product's end or start, so the same bits.
_QBLOCK = 64


def _blocks(T: int):
    # _QBLOCK-long blocks, the last one taking the remainder: never 1 wide (numpy would call gemv, other bits)
    cuts = list(range(0, T - _QBLOCK + 1, _QBLOCK))[1:] if T >= 2 * _QBLOCK else []
    return list(zip([0, *cuts], [*cuts, T]))


def _heads(a: np.ndarray) -> np.ndarray:
    return a.transpose(0, 2, 1, 3)  # [B, T, nh, x] <-> [B, nh, T, x], a view


def attention_forward(qkv: np.ndarray, n_head: int, p: float = 0.0, rng=None):
    # qkv [B, T, 3d] (c_attn output: q | k | v, heads contiguous inside each) -> causal MHA out [B, T, d]
    B, T, d = *qkv.shape[:2], qkv.shape[2] // 3
    hs = d // n_head
    heads = qkv.reshape(B, T, 3, n_head, hs)  # [B, T, 3, nh, hs] view
    # Strided views: each [T, hs] slab has unit column stride, so matmul hands them to BLAS without copies.
    k, v = _heads(heads[:, :, 1]), _heads(heads[:, :, 2])  # [B, nh, T, hs]
    scale = 1.0 / math.sqrt(hs)  # python float: stays in the array dtype
    qs = _heads(heads[:, :, 0]) * scale  # [B, nh, T, hs]: scaling q is 4x cheaper than the scores
    att = np.empty((B, T, n_head, T), dtype=qkv.dtype)  # [B, Tk, nh, Tq]
    for a, b in _blocks(T):  # [B, nh, Tk < b, Tq in a:b] = k.q/sqrt(hs)
        np.matmul(k[:, :, :b], qs[:, :, a:b].transpose(0, 1, 3, 2), out=_heads(att[:, :b, :, a:b]))
        att[:, b:, :, a:b] = -np.inf
    a3 = att.reshape(B, T, n_head * T)  # [B, Tk, nh*Tq] view
    a3 += _causal_bias(T, n_head, att.dtype)  # future keys -> -inf
    a3 -= a3.max(axis=1, keepdims=True)  # key j = i is never masked: every max is finite
    np.exp(a3, out=a3)
    a3 /= (_filled(T, 1.0, a3.dtype) @ a3)[:, None]  # / [B, 1, nh*Tq]: the sum over keys as B gemvs
    att_d, dcache = dropout_forward(att, p, rng)  # [B, Tk, nh, Tq]
    # [B, nh, Tq, Tk] @ [B, nh, Tk, hs] -> [B, nh, Tq, hs], written into the heads' strided slots: heads merged
    out = np.empty((B, T, d), dtype=qkv.dtype)
    o4 = _heads(out.reshape(B, T, n_head, hs))
    for a, b in _blocks(T):
        np.matmul(att_d[:, :b, :, a:b].transpose(0, 2, 3, 1), v[:, :, :b], out=o4[:, :, a:b])
    return out, (qs, k, v, att, att_d, dcache, _heads(o4), scale)


def attention_backward(dout: np.ndarray, cache):
    # dout [B, T, d] -> dqkv [B, T, 3d]
    qs, k, v, att, att_d, dcache, out4, scale = cache  # out4 [B, T, nh, hs]: the forward's output
    B, T, n_head, hs = out4.shape
    dout4 = dout.reshape(out4.shape)
    dy = _heads(dout4)  # [B, nh, Tq, hs] view
    dqkv = np.empty((B, T, 3, n_head, hs), dtype=dout.dtype)  # [B, T, 3, nh, hs]
    dq, dk, dv = (_heads(dqkv[:, :, i]) for i in range(3))  # [B, nh, T, hs] strided slots
    datt = np.empty((B, T, n_head, T), dtype=dout.dtype)  # [B, Tk, nh, Tq]
    for a, b in _blocks(T):  # keys a:b are seen by queries a: only
        np.matmul(_heads(att_d[:, a:b, :, a:]), dy[:, :, a:], out=dv[:, :, a:b])
        # grad wrt att_d for queries a:b and keys :b (the rest is never read)
        np.matmul(v[:, :, :b], dy[:, :, a:b].transpose(0, 1, 3, 2), out=_heads(datt[:, :b, :, a:b]))
        datt[:, b:, :, a:b] = 0.0
    datt = dropout_backward(datt, dcache)  # [B, Tk, nh, Tq] grad wrt the softmax output
    # Softmax backward needs sum_j datt_ij att_ij = dy_i . y_i (FlashAttention's D): computed on [T, hs],
    # 4x smaller than [T, T], and it holds with dropout too since y = (att * mask) @ v.
    rows = np.einsum("bthe,bthe->bht", dout4, out4)
    d3 = datt.reshape(B, T, n_head * T)  # [B, Tk, nh*Tq]
    d3 -= rows.reshape(B, 1, n_head * T)
    d3 *= att.reshape(B, T, n_head * T)  # grad wrt the scaled scores; 0 where masked
    for a, b in _blocks(T):  # d(qs), then dk
        np.matmul(datt[:, :b, :, a:b].transpose(0, 2, 3, 1), k[:, :, :b], out=dq[:, :, a:b])
        np.matmul(_heads(datt[:, a:b, :, a:]), qs[:, :, a:], out=dk[:, :, a:b])
    dqkv[:, :, 0] *= scale  # dq = d(qs) * scale
    return dqkv.reshape(B, T, 3 * n_head * hs)
