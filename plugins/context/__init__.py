"""Context managers: one plugin per file."""
