"""Built-in filters plugins."""
