"""furlong's built-in plugins. Reached only through entry points; the core never imports them."""
