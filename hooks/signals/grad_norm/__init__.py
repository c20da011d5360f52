"""Gradient norms measured during the backward pass."""
