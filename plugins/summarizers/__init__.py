"""Summarisers: one plugin per file."""
