"""An example of your own model and data for `pipeline`, by config only: an RBF network on two moons."""
