"""`python -m pipeline.verify [overrides]`: prove a resumed run equals the uninterrupted one, bit for bit.

Runs, each in a fresh process, the continuous run (verify.steps updates), the interrupted one (verify.cut
updates, checkpoint, stop), the full resume, and a negative control that restores everything but the RNG
streams; verify.kill=random instead SIGKILLs the real command at random points (chaos mode).
Exit 0: the full resume agrees and the negative control diverges; 1: a comparison failed (or the negative
control cannot diverge); 2: the verification could not complete (a bad override included).
"""

from __future__ import annotations

import argparse
import sys

from pipeline.run.signals import command


@command("pipeline.verify")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.verify",
        description=__doc__.split("\n\n")[0],
        epilog="Overrides are those of `python -m pipeline` (experiment=kernodeck, "
        "verify.cut=5, verify.steps=10, verify.kill=random, verify.trials=20).",
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from pipeline.config.compose import compose, to_plain
    from pipeline.config.schemas import validate

    config = to_plain(compose(args.overrides))  # a bad override: one line, exit 2
    validate(config)
    if config["verify"]["kill"] == "random":
        from pipeline.verify.chaos import run_chaos

        return run_chaos(config, args.overrides)
    from pipeline.verify.protocol import run_protocol

    return run_protocol(config, args.overrides)
