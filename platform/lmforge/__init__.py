"""lmforge: elastic training of large language models on Ray.

The path of a job is visible in the imports: spec -> preflight -> cluster (driver,
controller, workers) -> trainer -> engine + its loss. `lmforge.sdk` is the public
Python API; `lmforge.cli` is a thin layer over it.
"""

__version__ = "0.1.0"
