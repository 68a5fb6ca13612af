"""Stages built from config: policies that say when to stop, when to checkpoint and what to keep."""
