"""`python -m pipeline.verify [overrides]`: prove a resumed run equals the uninterrupted one, bit for bit.

Continuous, interrupted, resumed and resumed-without-RNG (the negative control) processes; verify.kill=random:
chaos mode. Exit 0 if they agree and the control diverges, 1 if not, 2 if incomplete (docs/verify.md)."""


def main(argv: list[str] | None = None) -> int:
    """Imports only once run_command holds the signals (the one wrapper, run/signals.py)."""
    import argparse

    from pipeline.config.compose import compose, to_plain
    from pipeline.config.schemas import validate

    epilog = "Overrides are those of `python -m pipeline` (experiment=kernodeck, verify.cut=5, "
    epilog += "verify.steps=10, verify.kill=random, verify.trials=20)."
    doc = __doc__.split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python -m pipeline.verify", description=doc, epilog=epilog)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = ap.parse_args(argv)
    config = to_plain(compose(args.overrides))  # a bad override: one line, exit 2
    validate(config)
    if config["verify"]["kill"] == "random":
        from pipeline.verify.chaos import run_chaos as run
    else:
        from pipeline.verify.protocol import run_protocol as run
    return run(config, args.overrides)


if __name__ == "__main__":
    from pipeline.run.signals import run_command

    run_command("pipeline.verify", main)
