"""Arithmetic on a model's tensors, for your own algorithm (docs/own-algorithm.md): a client rule's
tensors are lists aligned with the model's trainable parameters, a server rule's ordered dicts by
parameter name; these functions take either."""

from flatflower.common.tensors import EPS, Tensors, add, add_scaled, clone, global_norm, scale, sub, zeros_like

__all__ = ["EPS", "Tensors", "add", "add_scaled", "clone", "global_norm", "scale", "sub", "zeros_like"]
