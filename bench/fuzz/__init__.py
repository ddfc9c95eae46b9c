"""The differential fuzzer: random PPO/GRPO loss programs (`programs`: written as Python source from
named choices) compiled with graphpass and checked against eager and a float64 reference (`run`:
the comparator, the seed runner and the command line); `python -m bench.fuzz` runs it
(`__main__`)."""
