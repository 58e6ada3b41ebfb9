"""`python -m benchmarks ...` (from the repository root) = `specjax bench ...`."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
  sys.exit(main())
