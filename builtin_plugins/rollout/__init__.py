"""Built-in rollout plugins."""
