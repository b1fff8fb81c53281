"""The train side: train groups and workers, micro-batches, the advantage stages and the step objective."""
