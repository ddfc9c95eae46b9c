"""How the benchmarks measure. `isolate`: one measured process (the fork server, `run_isolated`, the
worker entry `python -m bench.harness.isolate --worker SPEC`), with `preload`, its fork server's one
preload; `spec`: what one worker measures (`Spec`) and the dtype names; `measure`: the suite's
measurement of one workload x method in its worker; `meters`: peak bytes and step time;
`sol_passes`: the machine's speed of light, the two passes over the logits; `machine_info`: this
machine and the commit measured; `ranks`: the multi-rank runner (gloo or NCCL ranks in spawned
processes, per-rank collective logs); `report`: tables, JSON and plots. The harness runs the loss
code of `bench.workloads` but never imports a benchmark module (`bench.suite`, `bench.sol`, ...):
they import it.
"""
