"""Softmax saturation at the logits: confidence, its gradient shrink, temperature."""
