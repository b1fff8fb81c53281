"""Plugin discovery, the plugin manager that calls every hook, selection by name, and adapters for dotted paths."""
