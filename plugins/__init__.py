"""Context-manager and summariser plugins (see ``plugins.registry``)."""
