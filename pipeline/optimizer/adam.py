"""Adam (L2 weight decay) and AdamW (decoupled weight decay), as torch.optim computes them."""

from __future__ import annotations

import math

import numpy as np

from pipeline.optimizer.base import Optimizer

# The update's ~14 element-wise passes run over pieces of this many bytes per array: p, g, m, v and the scratch
# (5 x 128 KiB) stay in L2 from one pass to the next; element-wise, so the same bits as whole-array passes.
_CHUNK_BYTES = 128 << 10


class Adam(Optimizer):
    buffers = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, weight_decay_on: str):  # fmt: skip
        super().__init__(params, lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        # all: every parameter; matrices: those of 2+ dimensions, not biases nor LayerNorm gains (GPT-2's, HF's groups)
        self.decays = {n: weight_decay_on == "all" or p.ndim >= 2 for n, p in self.params.items()}
        one_dtype = len({p.dtype for p in self.params.values()}) == 1
        self._flat = _Flat(self.params, self.state, self.decays) if one_dtype else None

    def step(self, grads: dict[str, np.ndarray]) -> None:
        """One update of every parameter. A model of one dtype is updated in place, large parameters chunk by
        chunk and the small ones packed into one array per decay group: the same bits per element."""
        flat, params = self._flat, self.params
        odd = set(grads) != set(params) or any(grads[n].dtype != p.dtype for n, p in params.items())
        if flat is None or odd or not all(p.flags.c_contiguous for p in params.values()):
            return super().step(grads)  # per parameter (also the one refusing mismatched gradients)
        self.t += 1
        for names, a, b, decay in flat.packs:  # small parameters: gathered, updated, scattered
            p, g = flat.p[: b - a], flat.g[: b - a]
            np.concatenate([params[n].reshape(-1) for n in names], out=p)
            np.concatenate([grads[n].reshape(-1) for n in names], out=g)
            self._chunks(flat, p, g, a, b, decay)
            for n, part in zip(names, np.split(p, np.cumsum([params[n].size for n in names[:-1]]))):
                np.copyto(params[n], part.reshape(params[n].shape))
        for n, a, b in flat.large:
            self._chunks(flat, params[n].reshape(-1), grads[n].reshape(-1), a, b, self.decays[n])

    def _chunks(self, flat: _Flat, p, g, a: int, b: int, decay: bool) -> None:
        # p and g (flat views) against the moments flat.m[a:b], flat.v[a:b], _CHUNK_BYTES at a time
        m, v, c = flat.m[a:b], flat.v[a:b], flat.chunk
        for s in range(0, p.size, c):
            e = min(s + c, p.size)
            self._apply(p[s:e], g[s:e], m[s:e], v[s:e], flat.tmp[: e - s], decay)

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        m, v = self._buffer("exp_avg", name), self._buffer("exp_avg_sq", name)
        self._apply(p, g, m, v, np.empty_like(m), self.decays[name])  # out=: an array even for 0-d

    def _apply(self, p, g, m, v, tmp, decay: bool) -> None:
        # torch's formulas, each elementwise operation in torch's order, through one scratch array: the same
        # bits as the plain expressions without their five temporaries per parameter.
        dt = p.dtype.type
        # torch's weight decay: decoupled (AdamW) shrinks p, L2 (Adam) uses g + wd p
        if self.weight_decay and decay:
            if self.decoupled:
                p *= dt(1 - self.lr * self.weight_decay)
            else:
                g = g + dt(self.weight_decay) * p
        np.subtract(g, m, out=tmp)  # g - m
        tmp *= dt(1 - self.beta1)
        m += tmp  # torch: exp_avg.lerp_(grad, 1 - beta1), i.e. m += (g - m) * (1 - beta1)
        v *= dt(self.beta2)
        np.multiply(g, dt(1 - self.beta2), out=tmp)
        tmp *= g
        v += tmp  # v = beta2 v + ((1 - beta2) g) g
        np.sqrt(v, out=tmp)
        tmp /= dt(math.sqrt(1 - self.beta2**self.t))
        tmp += dt(self.eps)  # denom = sqrt(v) / sqrt(bc2) + eps, bias correction bc2 = 1 - beta2^t
        np.divide(m, tmp, out=tmp)
        tmp *= dt(self.lr / (1 - self.beta1**self.t))
        p -= tmp  # p -= lr / bc1 * (m / denom), bc1 = 1 - beta1^t


class _Flat:
    """The moments m and v as two flat arrays (each name's state buffer a view into them, so checkpoints see
    per-name arrays): the small parameters first, one contiguous run per decay group, then the large ones."""

    def __init__(self, params: dict[str, np.ndarray], state: dict, decays: dict[str, bool]):
        self.dtype = next(iter(params.values())).dtype
        self.chunk = _CHUNK_BYTES // self.dtype.itemsize
        small = {n: p.size < self.chunk for n, p in params.items()}
        groups = {d: [n for n in params if small[n] and decays[n] == d] for d in (True, False)}
        order = groups[True] + groups[False] + [n for n in params if not small[n]]
        ends = np.cumsum([params[n].size for n in order]).tolist()
        span = {n: (e - params[n].size, e) for n, e in zip(order, ends)}
        self.m, self.v = np.zeros(ends[-1], self.dtype), np.zeros(ends[-1], self.dtype)
        for n, (a, b) in span.items():
            state[f"exp_avg.{n}"] = self.m[a:b].reshape(params[n].shape)
            state[f"exp_avg_sq.{n}"] = self.v[a:b].reshape(params[n].shape)
        # (names, start, end, decay) of each group of small parameters; (name, start, end) of the large
        self.packs = [(g, span[g[0]][0], span[g[-1]][1], d) for d, g in groups.items() if g]
        self.large = [(n, *span[n]) for n in order if not small[n]]
        packed = max([b - a for _, a, b, _ in self.packs], default=0)
        self.p, self.g = np.empty(packed, self.dtype), np.empty(packed, self.dtype)
        self.tmp = np.empty(self.chunk, self.dtype)


class AdamW(Adam):
    decoupled = True
