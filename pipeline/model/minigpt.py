"""A GPT-2 (pre-LN, tied head) in numpy with hand-written backward and Hugging Face parameter names."""

from __future__ import annotations

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
    """Stop glibc from handing freed heap back to the OS after every step (process-wide, idempotent).

    A step allocates and frees ~50 MB of 0.5-4 MB temporaries. With glibc's defaults the freed top of the
    heap is trimmed (or the block was mmapped) and the next step faults every page back in: ~10k page faults,
    about 25 ms per step on a 2-core VM, as much as the arithmetic. Raising the mmap and trim thresholds keeps
    those pages for reuse; RSS then stays at the peak working set instead of oscillating. No-op off glibc.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED or not sys.platform.startswith("linux"):
        return _MALLOC_TUNED
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    # 32 MiB is glibc's largest mmap threshold on 64-bit; setting both also disables the dynamic adjustment.
    _MALLOC_TUNED = (
        mallopt(m_mmap_threshold, 32 << 20) == 1 and mallopt(m_trim_threshold, 1 << 30) == 1
    )
    return _MALLOC_TUNED


def release_freed_memory() -> None:
    """Hand the heap keep_freed_memory kept back to the OS (glibc's malloc_trim): once the steps are over, so
    what comes after (matplotlib at a job's end) does not stack on the training working set's pages."""
    if _MALLOC_TUNED:
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MiniGPT(NamedParams):
    """GPT-2: wte + wpe, n_layer x (x + attn(ln_1 x); x + mlp(ln_2 x)), ln_f, head tied to wte.

    Thread safety (pipeline.trainer.parallel.Shards runs pieces of a batch concurrently on one model):
    loss_and_grads and evaluate only read params and keep no state between calls; every array they
    return is freshly allocated, the caller's to keep or overwrite.
    """

    needs = "tokens"  # the data kind it trains on

    def __init__(
        self,
        spec: DataSpec,
        n_layer: int,
        n_head: int,
        n_embd: int,
        block_size: int | None,
        dropout: float,
        attn_dropout: float | None,
        init_std: float,
        bias: bool,
        gelu: str,
        dtype: str,
        rng: np.random.Generator | None,
    ):
        # The values are validated (config/schemas.py: ranges, n_embd % n_head, dtype) and paired with the data
        # (run/assemble.py check_pairing) before any model is built.
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        if rng is None:
            # No hidden default seed: every draw of a run must come from one of its named streams.
            raise ValueError("MiniGPT needs rng (the run's init stream) to initialise its weights")
        self.vocab_size = int(spec.vocab_size)
        self.n_layer, self.n_head, self.n_embd = int(n_layer), int(n_head), int(n_embd)
        # Learned positions: the data's sequence length unless more are asked for (None: the data's).
        self.block_size = int(spec.block_size if block_size is None else block_size)
        if self.block_size < spec.block_size:
            raise ValueError(
                f"model.block_size {self.block_size} is shorter than the data's sequences "
                f"({spec.block_size} tokens)"
            )
        self.dropout, self.attn_dropout, self.dtype = (
            float(dropout),
            float(attn_dropout),
            np.dtype(dtype),
        )
        # bias=False: no bias in any linear layer or LayerNorm (nanoGPT's option); gelu: tanh (GPT-2's) or erf
        self.bias, self.gelu = bool(bias), str(gelu)
        self.params = self._init_params(float(init_std), rng)
        self.aliases = {"lm_head.weight": "transformer.wte.weight"}
        keep_freed_memory()

    @staticmethod
    def n_params(
        spec: DataSpec, n_layer: int, n_embd: int, block_size: int | None, bias: bool, **_
    ) -> int:
        """The parameter count __init__ would allocate (tied head once), computed without allocating it."""
        d, positions = int(n_embd), int(spec.block_size if block_size is None else block_size)
        per_layer, final = (
            (13 * d, 2 * d) if bias else (2 * d, d)
        )  # LayerNorm gains, and 11 d of biases a layer
        return (
            (int(spec.vocab_size) + positions) * d + int(n_layer) * (12 * d * d + per_layer) + final
        )

    def _init_params(self, std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
        # GPT-2's init. Draws are float64 then cast, so float32 and float64 models share one init;
        # the draw order is the (fixed) insertion order below.
        V, T, d = self.vocab_size, self.block_size, self.n_embd
        proj_std = std / math.sqrt(
            2 * self.n_layer
        )  # residual projections, so the stream's variance stays O(1)

        def normal(shape, s):
            return rng.normal(0.0, s, size=shape).astype(self.dtype)

        zeros, ones = partial(np.zeros, dtype=self.dtype), partial(np.ones, dtype=self.dtype)

        p = {
            "transformer.wte.weight": normal((V, d), std),
            "transformer.wpe.weight": normal((T, d), std),
        }
        for i in range(self.n_layer):
            h = f"transformer.h.{i}."
            p[h + "ln_1.weight"], p[h + "ln_1.bias"] = ones(d), zeros(d)
            p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"] = (
                normal((d, 3 * d), std),
                zeros(3 * d),
            )
            p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"] = (
                normal((d, d), proj_std),
                zeros(d),
            )
            p[h + "ln_2.weight"], p[h + "ln_2.bias"] = ones(d), zeros(d)
            p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"] = normal((d, 4 * d), std), zeros(4 * d)
            p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"] = (
                normal((4 * d, d), proj_std),
                zeros(d),
            )
        p["transformer.ln_f.weight"], p["transformer.ln_f.bias"] = ones(d), zeros(d)
        if (
            not self.bias
        ):  # the same draws in the same order: a bias-free model's weights are the biased one's
            p = {name: a for name, a in p.items() if not name.endswith(".bias")}
        return p

    @property
    def lm_head(self) -> np.ndarray:
        # The output head is the token embedding itself: one ndarray, never a copy.
        return self.params[self.aliases["lm_head.weight"]]

    def _forward(self, x: np.ndarray, rng: np.random.Generator | None):
        # x [B, T] int -> logits [B*T, V], caches; dropout only when rng is given
        p = (
            self.params
        )  # looked up on every call: optimizers and load_state_dict update these in place
        if x.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {x.shape}")
        pd, pa = (self.dropout, self.attn_dropout) if rng is not None else (0.0, 0.0)
        gelu = (
            L.gelu_erf_forward if self.gelu == "erf" else L.gelu_forward
        )  # looked up here: a profiler wraps them
        h, emb_c = L.embedding_forward(
            x, p["transformer.wte.weight"], p["transformer.wpe.weight"]
        )  # [B, T, d]
        h, emb_dc = L.dropout_forward(h, pd, rng)  # [B, T, d]
        blocks = []
        for i in range(self.n_layer):
            k = f"transformer.h.{i}."
            a, qkv_c = L.layernorm_linear_forward(
                h,
                p[k + "ln_1.weight"],
                p.get(k + "ln_1.bias"),
                p[k + "attn.c_attn.weight"],
                p.get(k + "attn.c_attn.bias"),
            )  # [B, T, 3d] = c_attn(ln_1(h))
            a, att_c = L.attention_forward(a, self.n_head, pa, rng)  # [B, T, d]
            a, aproj_c = L.linear_forward(
                a, p[k + "attn.c_proj.weight"], p.get(k + "attn.c_proj.bias")
            )  # [B, T, d]
            a, adrop_c = L.dropout_forward(a, pd, rng)  # [B, T, d]
            h += a  # [B, T, d] in place: no cache holds the residual stream (embedding output is a fresh copy)
            m, fc_c = L.layernorm_linear_forward(
                h,
                p[k + "ln_2.weight"],
                p.get(k + "ln_2.bias"),
                p[k + "mlp.c_fc.weight"],
                p.get(k + "mlp.c_fc.bias"),
            )  # [B, T, 4d] = c_fc(ln_2(h))
            m, gelu_c = gelu(m)  # [B, T, 4d]
            m, mproj_c = L.linear_forward(
                m, p[k + "mlp.c_proj.weight"], p.get(k + "mlp.c_proj.bias")
            )  # [B, T, d]
            m, mdrop_c = L.dropout_forward(m, pd, rng)  # [B, T, d]
            h += m  # [B, T, d]
            blocks.append((qkv_c, att_c, aproj_c, adrop_c, fc_c, gelu_c, mproj_c, mdrop_c))
        h, lnf_c = L.layernorm_forward(
            h, p["transformer.ln_f.weight"], p.get("transformer.ln_f.bias")
        )  # [B, T, d]
        logits, head_c = L.head_forward(h, self.lm_head)  # [N, V] tied head, no bias
        return logits, (emb_c, emb_dc, blocks, lnf_c, head_c)

    def _backward(
        self, dlogits: np.ndarray, row_scale: np.ndarray, caches, shape
    ) -> dict[str, np.ndarray]:
        # dlogits [N, V] * row_scale [N] per row -> grads keyed like self.params
        emb_c, emb_dc, blocks, lnf_c, head_c = caches
        B, T = shape
        g: dict[str, np.ndarray] = {}
        dh, dwte_head = L.head_backward(
            dlogits, head_c, row_scale
        )  # [N, d], [V, d] head use of the tied weight
        dh = dh.reshape(B, T, self.n_embd)  # [B, T, d]
        dh, g["transformer.ln_f.weight"], g["transformer.ln_f.bias"] = L.layernorm_backward(
            dh, lnf_c
        )  # [B, T, d]
        for i in reversed(range(self.n_layer)):
            k = f"transformer.h.{i}."
            qkv_c, att_c, aproj_c, adrop_c, fc_c, gelu_c, mproj_c, mdrop_c = blocks[i]
            dm = L.dropout_backward(dh, mdrop_c)  # [B, T, d]
            dm, g[k + "mlp.c_proj.weight"], g[k + "mlp.c_proj.bias"] = L.linear_backward(
                dm, mproj_c
            )  # [B, T, 4d]
            dm = L.gelu_backward(dm, gelu_c)  # [B, T, 4d]
            (
                dm,
                g[k + "ln_2.weight"],
                g[k + "ln_2.bias"],
                g[k + "mlp.c_fc.weight"],
                g[k + "mlp.c_fc.bias"],
            ) = L.layernorm_linear_backward(dm, fc_c)  # [B, T, d]
            dh += dm  # [B, T, d] residual branch joins; in place, as backward functions never keep dout
            da = L.dropout_backward(dh, adrop_c)  # [B, T, d]
            da, g[k + "attn.c_proj.weight"], g[k + "attn.c_proj.bias"] = L.linear_backward(
                da, aproj_c
            )  # [B, T, d]
            da = L.attention_backward(da, att_c)  # [B, T, 3d]
            (
                da,
                g[k + "ln_1.weight"],
                g[k + "ln_1.bias"],
                g[k + "attn.c_attn.weight"],
                g[k + "attn.c_attn.bias"],
            ) = L.layernorm_linear_backward(da, qkv_c)  # [B, T, d]
            dh += da  # [B, T, d]
        dh = L.dropout_backward(dh, emb_dc)  # [B, T, d]
        dwte, g["transformer.wpe.weight"] = L.embedding_backward(dh, emb_c)  # [V, d], [Tmax, d]
        dwte += dwte_head  # [V, d] tied: embedding use + head use
        g["transformer.wte.weight"] = dwte
        return {name: g[name] for name in self.params}

    def loss_and_grads(
        self, batch: Batch, rng: np.random.Generator | None
    ) -> tuple[float, dict[str, np.ndarray]]:
        x, y = np.asarray(batch.x), np.asarray(batch.y)  # [B, T] int
        logits, caches = self._forward(x, rng)  # [N, V]
        loss, d, row_scale = cross_entropy_factored(
            logits, y.reshape(-1)
        )  # dlogits = d * row_scale, in logits'
        return loss, self._backward(d, row_scale, caches, x.shape)

    def evaluate(self, batch: Batch) -> float:
        logits, _ = self._forward(np.asarray(batch.x), None)  # [N, V]
        loss, _ = cross_entropy(logits, np.asarray(batch.y).reshape(-1), overwrite=True)
        return loss

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x [B, T] int -> [B, T, V], eval mode (no dropout)
        x = np.asarray(x)
        out, _ = self._forward(x, None)  # [N, V]
        return out.reshape(*x.shape, self.vocab_size)
