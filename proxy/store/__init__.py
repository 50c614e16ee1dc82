"""Stores: cache backends (memory, disk, Redis), the summary cache, prefix tracking."""
