"""What optimizers share: the params they update, the lr a scheduler sets, and state (de)serialisation."""
from __future__ import annotations

import numpy as np


class Optimizer:
    """Holds per-parameter moment buffers keyed '<buffer>.<param name>' and the step count t."""

    buffers: tuple[str, ...] = ()

    def __init__(self, params: dict[str, np.ndarray], lr: float):
        # The model's live arrays, updated in place. A plain dict even when handed a mapping such as the
        # DictConfig hydra.utils.instantiate wraps a dict kwarg in: the same arrays, no config node around them.
        self.params = params if type(params) is dict else {name: params[name] for name in params}
        self.lr = float(lr)  # set by the scheduler before each step, like torch's param_groups
        self.t = 0
        self.state: dict[str, np.ndarray] = {}

    def _buffer(self, kind: str, name: str) -> np.ndarray:
        key = f"{kind}.{name}"
        if key not in self.state:
            self.state[key] = np.zeros_like(self.params[name])
        return self.state[key]

    def step(self, grads: dict[str, np.ndarray]) -> None:
        if set(grads) != set(self.params):
            raise KeyError(f"gradients do not match parameters: {sorted(set(grads) ^ set(self.params))}")
        self.t += 1
        for name, p in self.params.items():
            self._update(name, p, grads[name])

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        # Buffers are created eagerly so a checkpoint taken before step 1 has the same keys as later ones.
        for kind in self.buffers:
            for name in self.params:
                self._buffer(kind, name)
        return {"t": self.t, "lr": self.lr, **{k: self.state[k] for k in sorted(self.state)}}

    def load_state_dict(self, state: dict) -> None:
        arrays = {k: v for k, v in state.items() if k not in ("t", "lr")}
        expected = {f"{kind}.{name}" for kind in self.buffers for name in self.params}
        if set(arrays) != expected:
            raise KeyError(f"optimizer state keys differ: {sorted(set(arrays) ^ expected)}")
        for k, v in arrays.items():
            ref = self.params[k.split(".", 1)[1]]
            if v.shape != ref.shape or v.dtype != ref.dtype:
                raise ValueError(f"{k}: got {v.dtype}{list(v.shape)}, expected {ref.dtype}{list(ref.shape)}")
            self.state[k] = np.array(v, copy=True)
        self.t, self.lr = int(state["t"]), float(state["lr"])
