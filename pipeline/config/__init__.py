"""The config layer: value checks, schemas, composition, errors and exit codes, allowed targets, a run's identity."""
