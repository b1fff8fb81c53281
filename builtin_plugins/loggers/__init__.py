"""Built-in logger plugins (observer hooks): TensorBoard and Weights & Biases."""
