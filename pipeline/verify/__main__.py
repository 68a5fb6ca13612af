"""`python -m pipeline.verify [overrides]`: pipeline/verify/command.py, through the one wrapper (run/signals.py)."""

if __name__ == "__main__":
    from pipeline.run.signals import run_command

    run_command("pipeline.verify", "pipeline.verify.command")
