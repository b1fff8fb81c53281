"""One run: the loop, checkpoints, the run lock, metrics, weight sync and seeding."""
