"""The benchmarks, laid out by role: one top-level module per benchmark, each run as
`python -m bench.<name>` (suite, lm_head, tp, cp, distill, gpu, megatron, trl, ppo_memory,
memory_model_check, sol); `bench.harness`, how they measure (isolated workers, meters, the speed
of light's passes, machine information, the multi-rank runner, reports); `bench.workloads`, what
they run (the single-device, TP and CP loss code, and the methods compared); `bench.fuzz`, the
differential fuzzer (`python -m bench.fuzz`). Results go to `bench/results/`.
"""
