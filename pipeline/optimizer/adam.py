"""Adam (L2 weight decay) and AdamW (decoupled weight decay), as torch.optim computes them."""

from __future__ import annotations

import math

import numpy as np

from pipeline.optimizer.base import Optimizer


class Adam(Optimizer):
    buffers = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        weight_decay_on: str,
    ):
        super().__init__(params, lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        # all: every parameter; matrices: those of 2 or more dimensions (weights and embeddings, not biases nor
        # LayerNorm gains: GPT-2's, nanoGPT's and HF's groups)
        self.decays = {
            name: weight_decay_on == "all" or p.ndim >= 2 for name, p in self.params.items()
        }
        # Moments of a model of one dtype live in two flat arrays; each name's buffer is a view into them.
        self._flat = (
            _Flat(self.params, self.state)
            if len({p.dtype for p in self.params.values()}) == 1
            else None
        )

    def step(self, grads: dict[str, np.ndarray]) -> None:
        """One update of every parameter. A model of one dtype (and gradients of it) is updated as one flat array:
        each operation one pass over all parameters instead of one call per parameter, the same bits per element."""
        names = list(self.params)
        flat = self._flat
        if (
            flat is None
            or set(grads) != set(self.params)
            or any(grads[n].dtype != flat.p.dtype for n in names)
        ):
            super().step(
                grads
            )  # per parameter (also the one that refuses gradients that do not match)
            return
        self.t += 1
        np.concatenate([self.params[n].reshape(-1) for n in names], out=flat.p)
        np.concatenate([grads[n].reshape(-1) for n in names], out=flat.g)
        everything = all(self.decays.values())
        if self.weight_decay and not everything:
            for n, p, g in zip(names, flat.views(flat.p), flat.views(flat.g)):
                if self.decays[n]:
                    self._decay(p, g, scratch=True)
        self._apply(flat.p, flat.g, flat.m, flat.v, flat.tmp, decay=everything)
        for n, part in zip(names, flat.views(flat.p)):
            np.copyto(self.params[n], part)

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        m, v = self._buffer("exp_avg", name), self._buffer("exp_avg_sq", name)
        self._apply(
            p, g, m, v, np.empty_like(m), decay=self.decays[name]
        )  # out=: an array even for 0-d ones

    def _decay(self, p: np.ndarray, g: np.ndarray, scratch: bool = False) -> np.ndarray:
        """Weight decay, torch's: decoupled (AdamW) shrinks p in place; L2 (Adam) returns g + wd p, written into
        g only where g is the step's own scratch copy (`scratch`), never into a caller's gradient."""
        dt = p.dtype.type
        if self.decoupled:
            p *= dt(1 - self.lr * self.weight_decay)
            return g
        if scratch:
            g += dt(self.weight_decay) * p
            return g
        return g + dt(self.weight_decay) * p

    def _apply(
        self,
        p: np.ndarray,
        g: np.ndarray,
        m: np.ndarray,
        v: np.ndarray,
        tmp: np.ndarray,
        decay: bool,
    ) -> None:
        # torch's formulas, each elementwise operation in torch's order, through one scratch array: the same
        # bits as the plain expressions without their five temporaries per parameter.
        if self.weight_decay and decay:
            g = self._decay(p, g)
        dt = p.dtype.type
        np.subtract(g, m, out=tmp)  # g - m
        tmp *= dt(1 - self.beta1)
        m += tmp  # torch: exp_avg.lerp_(grad, 1 - beta1), i.e. m += (g - m) * (1 - beta1)
        v *= dt(self.beta2)
        np.multiply(g, dt(1 - self.beta2), out=tmp)
        tmp *= g
        v += tmp  # v = beta2 v + ((1 - beta2) g) g
        bias_correction1 = 1 - self.beta1**self.t
        bias_correction2_sqrt = math.sqrt(1 - self.beta2**self.t)
        np.sqrt(v, out=tmp)
        tmp /= dt(bias_correction2_sqrt)
        tmp += dt(self.eps)  # denom = sqrt(v) / sqrt(bc2) + eps
        np.divide(m, tmp, out=tmp)
        tmp *= dt(self.lr / bias_correction1)
        p -= tmp  # p -= lr / bc1 * (m / denom)


class _Flat:
    """Flat arrays over every parameter in dict order: the moments m and v (each name's state buffer a view into
    them, so checkpoints see per-name arrays), and the step's scratch copies of the parameters and gradients."""

    def __init__(self, params: dict[str, np.ndarray], state: dict[str, np.ndarray]):
        self.shapes = [p.shape for p in params.values()]
        self.bounds = np.cumsum([0] + [p.size for p in params.values()]).tolist()
        dtype = next(iter(params.values())).dtype
        n = self.bounds[-1]
        self.m, self.v = np.zeros(n, dtype), np.zeros(n, dtype)
        self.p, self.g, self.tmp = np.empty(n, dtype), np.empty(n, dtype), np.empty(n, dtype)
        for kind, flat in (("exp_avg", self.m), ("exp_avg_sq", self.v)):
            for name, view in zip(params, self.views(flat)):
                state[f"{kind}.{name}"] = view

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        return [
            flat[a:b].reshape(shape)
            for a, b, shape in zip(self.bounds[:-1], self.bounds[1:], self.shapes)
        ]


class AdamW(Adam):
    decoupled = True
