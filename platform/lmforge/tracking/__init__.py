"""Tracking: MLflow runs and the run directory's machine-readable files."""
