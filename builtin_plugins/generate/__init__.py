"""Built-in generate plugins."""
