"""Every bound on what the pipeline reads, one name, value and reason each (or a size a verified manifest lists)."""

MAX_JSON_DEPTH = 64  # nesting of any JSON read: deeper is refused, never recursed into
# manifest.json, extra.json, data.json: KBs (a 65,536-token vocab < 1 MB)
MAX_CHECKPOINT_JSON = 16 << 20
MAX_HEADER = 16 << 20  # a safetensors header: ~100 bytes a tensor
MAX_CORPUS_JSON = 16 << 20  # a corpus's MANIFEST.json or vocab.json: a few KB each
MAX_CORPORA = 10_000  # corpus directories looked at when finding one by its manifest's hash
MAX_TOKEN_FILE = 4 << 30  # a corpus's token file, memory-mapped: 2^31 uint16 tokens
MAX_TEXT_FILE = 32 << 20  # data.max_bytes of a config written before the key existed
MAX_RUN_JSON = 16 << 20  # a run's run.json and .hydra/*.yaml
MAX_METRICS = 1 << 30  # metrics.jsonl, read line by line when a run resumes
MAX_METRICS_LINE = 1 << 20  # one line of it: a logged step is a few hundred bytes
MAX_LOCK = 64  # a run's lock file: its holder's pid
MAX_CONF_YAML = 1 << 20  # a file of conf/, read for whether any can set hydra.mode
MAX_SWEEP_JSON = 1 << 24  # a sweep's sweep.json
MAX_SWEEP_RECORD = 1 << 26  # sweep.json or multirun.yaml kept to undo a sweep's start
MAX_JOB_RECORD = 1 << 20  # a sweep's jobs/N.json
MAX_SMALL = 16 << 20  # archive: a run's small files (.hydra/*, run.json, a corpus's MANIFEST.json)
MAX_SOURCE_FILE = 1 << 40  # archive: a file a run was trained on, checked against its recorded size
MAX_ARCHIVE_LISTING = 1 << 30  # an archive's MANIFEST.json
MAX_WORKER_CONFIG = 1 << 24  # the config a verifier's worker is given
MAX_SUMMARY = 1 << 30  # a verifier's summary JSON: records of every step
MAX_VOCAB_JSON = 64 << 20  # a registered model's vocab.json: a million tokens is a few MB
MAX_EVENT = 1 << 20  # one line from the tracking agent: an error message is cut at 2000
# one request line to the agent: a manifest.json (16 MiB, as JSON text within 6 times that) or
# link.MAX_METRICS_LINES metrics lines; a longer one closes its connection
MAX_REQUEST = 112 << 20
MAX_MOUNTS_BYTES = 1 << 20  # /proc/mounts
MAX_CURVES_BYTES = 16 << 20  # a run's curves.png: bigger is not ours (drawn again)
# an artifact this small is compared by content, not size: a resume rewrites .hydra/*.yaml in place, a new
# history makes step directories of the same names (its weights, too big to read, follow their manifest)
MAX_COMPARED_BYTES = 1 << 20
MAX_ARTIFACT = 64 << 20  # a logged artifact read back to compare
