"""The config layer: schemas and value checks, composition, what a config may name, a run's identity."""
