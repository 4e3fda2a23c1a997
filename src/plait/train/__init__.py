"""Train state, step, metrics and the training loop."""
