"""`python -m pipeline.sample CHECKPOINT prompt="..." [max_new_tokens=50] [temperature=1.0] [top_k=0] [seed=0]`.

Text from a MiniGPT checkpoint, through the vocabulary of the corpus it was trained on (the checkpoint's
data.json: the corpus itself is not needed): the prompt is split as the corpus joins tokens (words at
whitespace for data=grammar, characters for data=text), a word outside the vocabulary is refused naming it,
and the tokens are decoded with the corpus's join. An empty prompt starts after the corpus's end-of-sentence
token (`<eos>`), or for characters without one at a newline (nanoGPT's start). Each new token is drawn from
softmax(logits / temperature) over the top_k most likely tokens (0: all) of the last block_size tokens;
temperature=0 takes the most likely one.
The draws come from this command's own numpy Generator seeded with `seed`: the same seed, the same text.
Only for a checkpoint written before data.json existed (schema 2.0) is its training data built, found with
`data.path=FILE` (a moved text file) and `paths.output_dir=DIR` (the corpus cache).
Exit 0; 2 with one line for a checkpoint that does not verify or a bad argument (max_new_tokens above
100,000 included, refused before any work); 75 with one line if interrupted (SIGINT, SIGTERM).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.config.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError
from pipeline.model.generate import continuation, parse_options
from pipeline.run.signals import command, run_command

NAME = "pipeline.sample"


def sample(directory: Path, args: list[str]) -> str:
    from pipeline.run.trained import data_facts, restore_checkpoint
    from pipeline.serving import generates

    options, overrides = parse_options(args)
    manifest, state = restore_checkpoint(directory, overrides)
    if not generates(model := state.model):
        held = f"checkpoint {directory} holds a {manifest['config']['model'].get('_target_')}"
        raise ConfigError(f"{held}, which does not generate tokens (sample needs a MiniGPT)")
    facts = data_facts(manifest, overrides, directory)
    vocab, join = facts["vocab"], facts["decode_join"]
    if vocab is None or join is None:
        data = manifest["config"]["data"].get("_target_")
        raise ConfigError(f"data {data} has no vocabulary to decode tokens with")
    return continuation(model, vocab, join, options, facts["specials"].get("eos"))


@command(NAME)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return EXIT_OK if argv else EXIT_BAD_INPUT
    print(sample(Path(argv[0]), argv[1:]))
    return EXIT_OK


if __name__ == "__main__":
    run_command(NAME, main)
