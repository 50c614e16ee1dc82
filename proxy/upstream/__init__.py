"""The provider seam: a ``Provider`` per route (OpenAI-compatible HTTP, litellm), the summariser engine."""
