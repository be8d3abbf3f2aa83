"""`python -m ssr_bench ...`: the same command as `ssr bench ...` (ssr_bench.cli)."""

import sys

from .cli import main

sys.exit(main())
