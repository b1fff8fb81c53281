"""Built-in data plugins."""
