"""The vocabulary: neutral conversation items, bands, tool groups, pairing, token counting, budget, errors."""
