"""`python -m lmforge` is the `lmforge` console script."""

from lmforge.cli import main

raise SystemExit(main())
