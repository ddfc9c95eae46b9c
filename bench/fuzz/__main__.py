"""`python -m bench.fuzz`: the differential fuzzer's command line (`bench.fuzz.run.main`; its
`--help` and the module docstring of `bench.fuzz.run` give the options)."""

import sys

from bench.fuzz.run import main

if __name__ == "__main__":
    sys.exit(main())
