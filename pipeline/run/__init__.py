"""The run core: assemble a job, hold its run directory, run its stages, signals and budgets, exit codes."""
