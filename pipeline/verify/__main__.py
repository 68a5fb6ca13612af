"""`python -m pipeline.verify [overrides]`: prove a resumed run equals the uninterrupted one, bit for bit.

Exit 0: the full resume agrees and the negative control (no RNG restore) diverges; 1: a comparison
failed (or the negative control cannot diverge); 2: the verification could not complete.
"""
from __future__ import annotations

import sys

EXIT_OK, EXIT_MISMATCH, EXIT_INCOMPLETE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config import CONFIG_DIR, register_all

    register_all()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=argv)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"pipeline.verify: bad override: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_INCOMPLETE
    if cfg.verify.kill == "random":
        from pipeline.verify.chaos_mode import run_chaos

        return run_chaos(cfg, argv)
    if cfg.verify.kill != "none":
        print(f"pipeline.verify: verify.kill must be 'none' or 'random', got {cfg.verify.kill!r}", file=sys.stderr)
        return EXIT_INCOMPLETE
    from pipeline.verify.protocol import run_protocol

    return run_protocol(cfg, argv)


if __name__ == "__main__":
    sys.exit(main())
