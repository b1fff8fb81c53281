"""Built-in buffer plugins."""
