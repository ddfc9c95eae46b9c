"""How the benchmarks measure: the isolated worker process (`isolate`: the fork server, `run_isolated`,
the worker entry, its meters, machine information and the suite's measurement), the fork server's
preload (`preload`), the multi-rank runner (`ranks`) and the rendering of results (`report`). Nothing
here imports a benchmark module (`bench.suite`, `bench.sol`, ...): they import it.
"""
