"""Parameter health: drift of parameters from their reference, weight decay, gradients."""
