"""A GPT-2 (pre-LN, tied head) in numpy with hand-written backward and Hugging Face parameter names."""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
from functools import partial

import numpy as np

from pipeline.data.base import Batch, DataSpec
from pipeline.model import layers as L
from pipeline.model.base import NamedParams
from pipeline.model.losses import cross_entropy, cross_entropy_factored

_MALLOC_TUNED = False


def keep_freed_memory() -> bool:
    """Keep freed heap for reuse (glibc, process-wide): a step frees ~50 MB of 0.5-4 MB temporaries, and
    trimmed, the next one faults every page back in (~25 ms a step on 2 cores). RSS stays at its peak."""
    global _MALLOC_TUNED
    if not _MALLOC_TUNED and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no glibc: nothing tuned
            mallopt = ctypes.CDLL("libc.so.6").mallopt
            # M_MMAP_THRESHOLD (-3) at its 64-bit maximum and M_TRIM_THRESHOLD (-1): no dynamic adjustment either
            _MALLOC_TUNED = mallopt(-3, 32 << 20) == 1 and mallopt(-1, 1 << 30) == 1
    return _MALLOC_TUNED


def release_freed_memory() -> None:
    """Hand the kept heap back (malloc_trim) once the steps are over: the job's end does not stack on it."""
    if _MALLOC_TUNED:
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# A block's parameters (after transformer.h.<i>.), in the order the layer functions take and return them
_SUBLAYERS = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
_BLOCK_PARAMS = tuple(f"{m}.{k}" for m in _SUBLAYERS for k in ("weight", "bias"))
_WTE, _WPE, _LNF_B = "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.bias"


class MiniGPT(NamedParams):
    """GPT-2: wte + wpe, n_layer x (x + attn(ln_1 x); x + mlp(ln_2 x)), ln_f, head tied to wte.
    loss_and_grads and evaluate only read params and return fresh arrays: safe to run concurrently (Shards)."""

    needs = "tokens"  # the data kind it trains on

    def __init__(self, spec: DataSpec, n_layer: int, n_head: int, n_embd: int, block_size: int | None,
                 dropout: float, attn_dropout: float | None, init_std: float, bias: bool, gelu: str, dtype: str,
                 rng: np.random.Generator | None):  # fmt: skip
        # validated (config/schemas.py) and paired with the data (run/assemble.py check_pairing) first
        if rng is None:
            # No hidden default seed: every draw of a run must come from one of its named streams.
            raise ValueError("MiniGPT needs rng (the run's init stream) to initialise its weights")
        self.vocab_size = int(spec.vocab_size)
        self.n_layer, self.n_head, self.n_embd = int(n_layer), int(n_head), int(n_embd)
        self.block_size = int(spec.block_size if block_size is None else block_size)
        if self.block_size < spec.block_size:
            said = f"model.block_size {self.block_size} is shorter than the data's sequences"
            raise ValueError(f"{said} ({spec.block_size} tokens)")
        self.dropout = float(dropout)
        self.attn_dropout = float(dropout if attn_dropout is None else attn_dropout)
        self.dtype, self.bias, self.gelu = np.dtype(dtype), bool(bias), str(gelu)
        self.params = self._init_params(float(init_std), rng)
        self.aliases = {"lm_head.weight": "transformer.wte.weight"}
        keep_freed_memory()

    @staticmethod
    def n_params(spec: DataSpec, n_layer: int, n_embd: int, block_size: int | None, bias, **_):
        """The parameter count __init__ would allocate (tied head once), without allocating it."""
        d, positions = int(n_embd), int(spec.block_size if block_size is None else block_size)
        # LayerNorm gains, and 11 d of biases a layer
        layer, final = (13 * d, 2 * d) if bias else (2 * d, d)
        return (int(spec.vocab_size) + positions) * d + int(n_layer) * (12 * d * d + layer) + final

    def _init_params(self, std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
        # GPT-2's init in insertion order, each array drawn in float64 then cast (float32 and float64 share it);
        # the residual projections' std / sqrt(2 n_layer) keeps the stream's variance O(1)
        V, T, d, dt = self.vocab_size, self.block_size, self.n_embd, self.dtype
        proj, normal = std / math.sqrt(2 * self.n_layer), partial(rng.normal, 0.0)
        p = {_WTE: np.asarray(normal(std, (V, d)), dt), _WPE: np.asarray(normal(std, (T, d)), dt)}
        for h in (f"transformer.h.{i}." for i in range(self.n_layer)):
            ws: tuple = (np.ones(d), normal(std, (d, 3 * d)), normal(proj, (d, d)), np.ones(d),
                         normal(std, (d, 4 * d)), normal(proj, (4 * d, d)))  # fmt: skip
            for m, w in zip(_SUBLAYERS, ws):  # each bias as wide as its layer's output
                p[h + m + ".weight"], p[h + m + ".bias"] = w.astype(dt), np.zeros(w.shape[-1], dt)
        p["transformer.ln_f.weight"], p[_LNF_B] = np.ones(d, dt), np.zeros(d, dt)
        # the same draws in the same order: a bias-free model's weights are the biased one's
        return p if self.bias else {name: a for name, a in p.items() if not name.endswith(".bias")}

    @property
    def lm_head(self) -> np.ndarray:  # the token embedding itself: one ndarray, never a copy
        return self.params[self.aliases["lm_head.weight"]]

    def _forward(self, x: np.ndarray, rng: np.random.Generator | None):
        # x [B, T] int -> logits [B*T, V], caches; dropout only when rng is given. params and the GELU
        # are looked up on every call (optimizers update params in place; a profiler wraps the GELU).
        p = self.params
        if x.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {x.shape}")
        pd, pa = (self.dropout, self.attn_dropout) if rng is not None else (0.0, 0.0)
        h, emb_c = L.embedding_forward(x, p[_WTE], p[_WPE])  # [B, T, d]
        h, emb_dc = L.dropout_forward(h, pd, rng)
        blocks = []
        for i in range(self.n_layer):
            w: list = [p.get(f"transformer.h.{i}.{n}") for n in _BLOCK_PARAMS]
            a, qkv_c = L.layernorm_linear_forward(h, *w[0:4])  # [B, T, 3d] = c_attn(ln_1(h))
            a, att_c = L.attention_forward(a, self.n_head, pa, rng)  # [B, T, d]
            a, aproj_c = L.linear_forward(a, *w[4:6])
            a, adrop_c = L.dropout_forward(a, pd, rng)
            # in place: no cache holds the residual stream (the embedding's output is a fresh array)
            h += a
            m, fc_c = L.layernorm_linear_forward(h, *w[6:10])  # [B, T, 4d] = c_fc(ln_2(h))
            m, gelu_c = L.gelu_forward(m, self.gelu == "erf")
            m, mproj_c = L.linear_forward(m, *w[10:12])  # [B, T, d]
            m, mdrop_c = L.dropout_forward(m, pd, rng)
            h += m
            blocks.append((qkv_c, att_c, aproj_c, adrop_c, fc_c, gelu_c, mproj_c, mdrop_c))
        h, lnf_c = L.layernorm_forward(h, p["transformer.ln_f.weight"], p.get(_LNF_B))
        logits, head_c = L.head_forward(h, self.lm_head)  # [N, V] tied head, no bias
        return logits, (emb_c, emb_dc, blocks, lnf_c, head_c)

    def loss_and_grads(self, batch: Batch, rng: np.random.Generator | None):
        logits, (emb_c, emb_dc, blocks, lnf_c, head_c) = self._forward(np.asarray(batch.x), rng)
        # dlogits [N, V] = d * row_scale[:, None], d in logits' memory; the backward's grads keyed like self.params
        loss, d, row_scale = cross_entropy_factored(logits, np.asarray(batch.y).reshape(-1))
        g: dict[str, np.ndarray] = {}
        dh, dwte_head = L.head_backward(d, head_c, row_scale)  # [N, d]; [V, d]: the head's
        dh, g["transformer.ln_f.weight"], g[_LNF_B] = L.layernorm_backward(dh, lnf_c)  # [B, T, d]
        for i in reversed(range(self.n_layer)):
            names = [f"transformer.h.{i}.{n}" for n in _BLOCK_PARAMS]
            qkv_c, att_c, aproj_c, adrop_c, fc_c, gelu_c, mproj_c, mdrop_c = blocks[i]
            dm = L.dropout_backward(dh, mdrop_c)  # [B, T, d]
            dm, *g_mproj = L.linear_backward(dm, mproj_c)  # [B, T, 4d]
            dm = L.gelu_backward(dm, gelu_c)
            dm, *g_fc = L.layernorm_linear_backward(dm, fc_c)  # [B, T, d]
            dh += dm  # the residual branch joins, in place: backward functions never keep dout
            da = L.dropout_backward(dh, adrop_c)
            da, *g_aproj = L.linear_backward(da, aproj_c)
            da = L.attention_backward(da, att_c)  # [B, T, 3d]
            da, *g_qkv = L.layernorm_linear_backward(da, qkv_c)  # [B, T, d]
            g.update(zip(names, g_qkv + g_aproj + g_fc + g_mproj))
            dh += da
        g[_WTE], g[_WPE] = L.embedding_backward(L.dropout_backward(dh, emb_dc), emb_c)
        g[_WTE] += dwte_head  # tied: the embedding's use + the head's
        return loss, {name: g[name] for name in self.params}

    def evaluate(self, batch: Batch) -> float:
        logits = self._forward(np.asarray(batch.x), None)[0]  # [N, V]
        return cross_entropy(logits, np.asarray(batch.y).reshape(-1), overwrite=True)[0]

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x [B, T] int -> [B, T, V], eval mode (no dropout)
        return self._forward(np.asarray(x), None)[0].reshape(*np.shape(x), self.vocab_size)
