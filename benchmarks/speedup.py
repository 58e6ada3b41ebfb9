"""`specjax bench --suite speedup`; extra arguments are passed through (see benchmarks/README.md)."""

import sys

from specjax import bench

if __name__ == "__main__":
  sys.exit(bench.main(["--suite", "speedup", *sys.argv[1:]]))
