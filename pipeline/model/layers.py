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
    db = d2.sum(axis=0) if has_bias else None  # [out]
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


def layernorm_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5):
    # x [..., d], w [d], b [d] -> out [..., d], normalised over the last axis
    mu = x.mean(axis=-1, keepdims=True)  # [..., 1]
    xc = x - mu  # [..., d]
    var = np.mean(xc * xc, axis=-1, keepdims=True)  # [..., 1] biased variance, as torch
    rstd = 1.0 / np.sqrt(var + eps)  # [..., 1]
    xhat = xc  # reuse the buffer: xc is not needed past this point
    xhat *= rstd  # [..., d]
    out = xhat * w  # [..., d]
    out += b  # [..., d]
    return out, (xhat, rstd, w)


def layernorm_backward(dout: np.ndarray, cache):
    # dout [..., d] -> dx [..., d], dw [d], db [d]
    xhat, rstd, w = cache
    d = w.shape[0]
    d2, xhat2 = dout.reshape(-1, d), xhat.reshape(-1, d)  # [N, d]
    dw = np.einsum("nd,nd->d", d2, xhat2)  # [d]: avoids an [N, d] temporary
    db = d2.sum(axis=0)  # [d]
    dxhat = dout * w  # [..., d]
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), the two means over the last axis
    m1 = dxhat.mean(axis=-1, keepdims=True)  # [..., 1]
    m2 = np.mean(dxhat * xhat, axis=-1, keepdims=True)  # [..., 1]
    dx = dxhat  # reuse the buffer
    dx -= m1  # [..., d]
    dx -= xhat * m2  # [..., d]
    dx *= rstd  # [..., d]
    return dx, dw, db


def gelu_forward(x: np.ndarray):
    # x [...] -> 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's "gelu_new"
    x2 = x * x  # [...]
    inner = x2 * _GELU_A  # [...]
    inner += 1.0
    inner *= x
    inner *= _GELU_C  # [...] sqrt(2/pi) (x + a x^3)
    t = np.tanh(inner, out=inner)  # [...]
    out = t + 1.0  # [...]
    out *= x
    out *= 0.5
    return out, (x, x2, t)


def gelu_backward(dout: np.ndarray, cache):
    # dout [...] -> dx [...]; d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)
    x, x2, t = cache
    du = x2 * (3.0 * _GELU_A)  # [...]
    du += 1.0
    du *= x
    du *= 0.5 * _GELU_C  # [...] 0.5 x c (1 + 3 a x^2)
    sech2 = t * t  # [...]
    np.subtract(1.0, sech2, out=sech2)  # [...] 1 - t^2
    du *= sech2
    du += 0.5 * t
    du += 0.5  # [...] full derivative
    du *= dout
    return du


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
def _causal_bias(T: int, dtype: np.dtype) -> np.ndarray:
    # [T, T]: 0 on and below the diagonal, -inf above, so exp() zeroes attention to future positions
    bias = np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1)  # [T, T]
    bias.flags.writeable = False
    return bias


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
    qs = heads[:, :, 0].transpose(0, 2, 1, 3) * scale  # [B, nh, T, hs]; scaling q is 4x cheaper than att
    att = qs @ k.transpose(0, 1, 3, 2)  # [B, nh, T, T]
    att += _causal_bias(T, att.dtype)  # [B, nh, T, T] future -> -inf
    att -= att.max(axis=-1, keepdims=True)  # [B, nh, T, T]; the diagonal keeps every row max finite
    np.exp(att, out=att)  # [B, nh, T, T]
    att /= att.sum(axis=-1, keepdims=True)  # [B, nh, T, T] softmax
    att_d, dcache = dropout_forward(att, p, rng)  # [B, nh, T, T]
    y = att_d @ v  # [B, nh, T, hs]
    out = y.transpose(0, 2, 1, 3).reshape(B, T, d)  # [B, T, d] heads merged (copy)
    return out, (qs, k, v, att, att_d, dcache, out, n_head, scale)


def attention_backward(dout: np.ndarray, cache):
    # dout [B, T, d] -> dqkv [B, T, 3d]
    qs, k, v, att, att_d, dcache, out, n_head, scale = cache
    B, T, d = dout.shape
    hs = d // n_head
    dy = dout.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # [B, nh, T, hs] view
    dqkv = np.empty((B, T, 3, n_head, hs), dtype=dout.dtype)  # [B, T, 3, nh, hs]
    # matmul writes straight into the strided q/k/v slots of dqkv: no merge copy afterwards.
    np.matmul(att_d.transpose(0, 1, 3, 2), dy, out=dqkv[:, :, 2].transpose(0, 2, 1, 3))  # dv [B, nh, T, hs]
    datt = dy @ v.transpose(0, 1, 3, 2)  # [B, nh, T, T] grad wrt the dropped-out probabilities
    datt = dropout_backward(datt, dcache)  # [B, nh, T, T] grad wrt the softmax output
    # Softmax backward needs rowsum(datt * att) = rowsum(dy * y) (FlashAttention's D): the [T, hs] form
    # is 4x smaller than [T, T] and holds with dropout too, since y = (att * mask) @ v.
    rows = np.einsum("bthe,bthe->bht", dout.reshape(B, T, n_head, hs), out.reshape(B, T, n_head, hs))  # [B, nh, T]
    datt -= rows[..., None]  # [B, nh, T, T]
    datt *= att  # [B, nh, T, T] grad wrt the scaled scores; masked entries are 0 since att is 0 there
    np.matmul(datt, k, out=dqkv[:, :, 0].transpose(0, 2, 1, 3))  # d(qs) [B, nh, T, hs]
    dqkv[:, :, 0] *= scale  # [B, T, nh, hs] dq = d(qs) * scale
    np.matmul(datt.transpose(0, 1, 3, 2), qs, out=dqkv[:, :, 1].transpose(0, 2, 1, 3))  # dk [B, nh, T, hs]
    return dqkv.reshape(B, T, 3 * d)
