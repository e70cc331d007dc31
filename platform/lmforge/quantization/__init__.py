"""Weight-only quantization: int8 and int4 blocks stored as plain safetensors parts
(`quantize.py`), and `lmforge quantize` with its size and perplexity report (`command.py`)."""
