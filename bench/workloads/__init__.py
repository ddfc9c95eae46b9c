"""What the benchmarks run: RL loss code as trainers write it, and the ways of executing it.

`losses` holds the single-device losses over policy logits `[T, V]` (PPO, GRPO with k3-KL), their
inputs and the blockwise fp32 reference; `tp_losses` the tensor-parallel (vocab-parallel) loss code
of megatron-core, slime and verl; `cp_losses` the losses written once for one device and run under
context parallelism; `methods` the peers compared on them: how eager, inductor, inductor's
auto-chunker, a hand-written chunk loop and graphpass each execute a loss. Nothing here measures:
that is `bench.harness`.
"""
