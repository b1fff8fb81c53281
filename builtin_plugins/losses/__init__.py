"""Built-in losses plugins."""
