"""Distillation: divergences between teacher and student distributions (logits,
dense or top-k), hidden-state matching through learned adapters."""
