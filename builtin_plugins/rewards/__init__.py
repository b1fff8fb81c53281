"""Built-in rewards plugins."""
