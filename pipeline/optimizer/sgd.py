"""SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD computes it."""

from __future__ import annotations

import numpy as np

from pipeline.optimizer.base import Optimizer


class SGD(Optimizer):
    def __init__(self, params, lr: float, momentum: float, dampening: float, nesterov: bool,
                 weight_decay: float):  # fmt: skip
        super().__init__(params, lr)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")
        self.momentum, self.dampening = momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay
        self.buffers = ("momentum_buffer",) if momentum else ()

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        dt = p.dtype.type
        d_p = g + dt(self.weight_decay) * p if self.weight_decay else g
        if self.momentum:
            buf = self._buffer("momentum_buffer", name)
            if self.t == 1:  # torch initialises the buffer with the first gradient, undamped
                np.copyto(buf, d_p)
            else:
                buf *= dt(self.momentum)
                buf += dt(1 - self.dampening) * d_p
            d_p = d_p + dt(self.momentum) * buf if self.nesterov else buf
        p -= dt(self.lr) * d_p
