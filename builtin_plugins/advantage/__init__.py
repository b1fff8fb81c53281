"""Built-in advantage plugins."""
