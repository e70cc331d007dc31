"""Data: tokenizers, the `prepare` pipeline (Ray Data -> Parquet shards), and the
deterministic, resumable feed of global batches."""
