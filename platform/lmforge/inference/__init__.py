"""Generation for the plain model: a KV cache, prefill and incremental decode,
sampling; used from the CLI and SDK, and later by distillation and serving."""
