"""What optimizers share: the params they update, the lr a scheduler sets, and state (de)serialisation."""

from __future__ import annotations

import numpy as np

from pipeline.stateful import BadValue


class Optimizer:
    """Holds per-parameter moment buffers keyed '<buffer>.<param name>' and the step count t."""

    buffers: tuple[str, ...] = ()

    def __init__(self, params: dict[str, np.ndarray], lr: float):
        # The live arrays, updated in place; a plain dict even when instantiate hands them wrapped in a DictConfig
        self.params = params if type(params) is dict else {name: params[name] for name in params}
        self.lr = float(lr)  # set by the scheduler before each step, like torch's param_groups
        self.t = 0
        self.state: dict[str, np.ndarray] = {}

    def _buffer(self, kind: str, name: str) -> np.ndarray:
        if (key := f"{kind}.{name}") not in self.state:
            self.state[key] = np.zeros_like(self.params[name])
        return self.state[key]

    def step(self, grads: dict[str, np.ndarray]) -> None:
        if set(grads) != set(self.params):
            odd = sorted(set(grads) ^ set(self.params))
            raise KeyError(f"gradients do not match parameters: {odd}")
        self.t += 1
        for name, p in self.params.items():
            self._update(name, p, grads[name])

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """{"t": updates taken, "<buffer>": {param name: live array}}. The lr is not state: the scheduler sets it
        from the config's base lr and its own counter, so an allowed change of optimizer.lr takes effect."""
        # Buffers are created eagerly so a checkpoint taken before step 1 has the same keys as later ones.
        buffers = {k: {n: self._buffer(k, n) for n in self.params} for k in self.buffers}
        return {"t": self.t, **buffers}

    def check_state_dict(self, state: dict) -> None:
        if state["t"] < 0:
            raise BadValue("t", f"t={state['t']} is negative")

    def load_state_dict(self, state: dict) -> None:
        for kind in self.buffers:
            for name, a in state[kind].items():
                np.copyto(self._buffer(kind, name), a)
        self.t = int(state["t"])
