"""Datasets and the resumable data iterator."""
