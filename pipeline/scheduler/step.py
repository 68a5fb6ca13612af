"""StepLR: lr = base_lr * gamma ** (k // step_size), torch's closed form."""

from pipeline.scheduler.base import Scheduler


class StepLR(Scheduler):
    def __init__(self, optimizer, step_size: int, gamma: float):
        if step_size < 1:
            raise ValueError(f"scheduler.step_size must be >= 1, got {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer)

    def lr_at(self, k: int) -> float:
        return self.base_lr * self.gamma ** (k // self.step_size)
