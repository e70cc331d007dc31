"""lmforge: elastic training of large language models on Ray.

The path of a job is visible in the imports: spec -> plan -> cluster (controller,
workers) -> engine. `lmforge.sdk` is the public Python API.
"""

__version__ = "0.1.0"
