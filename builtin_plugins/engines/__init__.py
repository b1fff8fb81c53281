"""Built-in engines plugins."""
