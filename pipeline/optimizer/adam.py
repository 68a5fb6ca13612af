"""Adam (L2 weight decay) and AdamW (decoupled weight decay), as torch.optim computes them."""
from __future__ import annotations

import math

import numpy as np

from pipeline.optimizer.base import Optimizer


class Adam(Optimizer):
    buffers = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        # torch's formulas, each elementwise operation in torch's order, through one scratch array: the same
        # bits as the plain expressions without their five temporaries per parameter.
        dt = p.dtype.type
        if self.weight_decay:
            if self.decoupled:
                p *= dt(1 - self.lr * self.weight_decay)
            else:
                g = g + dt(self.weight_decay) * p
        m, v = self._buffer("exp_avg", name), self._buffer("exp_avg_sq", name)
        tmp = np.subtract(g, m, out=np.empty_like(m))  # g - m (out=: an array even for 0-d parameters)
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


class AdamW(Adam):
    decoupled = True
