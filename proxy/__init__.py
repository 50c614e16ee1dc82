"""ctxproxy: an OpenAI-compatible reverse proxy that manages conversation context."""

__version__ = "0.1.0"
