"""From a trained model to a product: weight-only quantization (`quantize`), an
OpenAI-compatible server on Ray Serve with continuous batching (`engine`, `api`,
`app`), and pairwise LLM-as-judge evaluation over any such server (`judge`)."""
