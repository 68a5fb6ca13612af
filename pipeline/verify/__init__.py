"""The resume verifier: bit-exact resume proven in fresh processes, with a negative control, and under SIGKILL."""
