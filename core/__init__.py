"""furlong core: CLI and config, plugin manager, the loop, rollout manager, checkpoints."""
