"""The suite's measurement of one (workload, method, shape, dtype) in its worker: `measure(spec)`,
the default `measure_fn` of `bench.harness.isolate.run_isolated` (also `bench.gpu`'s logits case):
build inputs, warm up (compile), then per timed step measure the peak bytes above the pre-step
baseline and the wall time (and the speed of light on the same logits, `bench.harness.sol_passes`),
then compare the last step's loss and logits.grad with an eager fp32 reference.
"""

from __future__ import annotations

import os
import statistics

from bench.harness.meters import CpuMeter, CudaMeter, timed
from bench.harness.spec import Spec, torch_dtype


def measure(spec: Spec) -> dict:
    """The worker's measurement of one configuration."""
    import torch

    from bench.workloads import losses
    from bench.workloads.methods import METHODS, warning

    torch.manual_seed(spec.seed)
    workload = losses.Workload.parse(spec.workload)
    method = METHODS[spec.method]
    if (why := method.available()) is not None:
        return dict(status="unavailable", note=why)
    batch = losses.make_batch(spec.T, spec.V, torch_dtype(spec.dtype), spec.device, workload.temperature, spec.seed)
    args = [batch[k] for k in losses.BATCH_FIELDS]
    logits = batch["logits"]
    fn, notes = method.build(workload, spec.compiler)
    meter = CudaMeter() if spec.device.startswith("cuda") else CpuMeter()
    loss = None

    def step():
        nonlocal loss
        logits.grad = None
        loss = fn(*args)
        loss.backward()
        meter.sync()

    # A compiled method's first call compiles: it is the warm-up, timed apart. An eager method has
    # nothing to warm up, so its first call is already a measured step.
    first_call_s = timed(step, spec.device) if method.compiled or spec.warmup else None
    passes = None
    if spec.sol:
        from bench.harness.sol_passes import Passes

        passes = Passes(logits.detach(), spec.seed)
        passes.step()  # compiles the backward pass
    times, peaks, sol_times = [], [], []
    while len(times) < spec.min_steps or (
        len(times) < spec.steps and sum(times) + statistics.median(times) <= spec.time_budget_s
    ):
        # Drop the previous step's outputs before the baseline: the baseline is inputs only.
        logits.grad, loss = None, None
        if passes is not None:  # before the baseline: its memory is not the method's
            sol_times.append(sum(passes.step()))
        baseline = meter.reset()
        times.append(timed(step, spec.device))
        peaks.append(meter.peak())
    if first_call_s is None:
        first_call_s = times[0]
    result = dict(
        status="ok",
        peak_bytes=max(peaks),
        peaks=peaks,
        ratio=max(peaks) / spec.floor_bytes,
        time_s=statistics.median(times),
        times=times,
        first_call_s=first_call_s,
        baseline_bytes=baseline,
        loss=float(loss),
    )
    if sol_times:
        # Paired: each step over the SoL step right before it, so a drifting machine cancels out.
        result.update(sol_s=statistics.median(sol_times), sol_times=sol_times,
                      x_sol=statistics.median(t / s for t, s in zip(times, sol_times)))
    result["notes"] = notes()
    result["warning"] = warning(result["notes"])
    if spec.reference:
        grad, loss_value = logits.grad.detach(), float(loss)
        loss = None
        cache = os.path.join(spec.reference_cache, spec.reference_key + ".pt") if spec.reference_cache else None
        if spec.method == "eager" and spec.dtype == spec.reference_dtype == "fp32":  # it is the reference
            result.update(losses.eager_fp32_as_reference(batch, loss_value, grad, cache))
        else:
            result.update(losses.reference_diffs(workload, batch, loss_value, grad, cache,
                                                 torch_dtype(spec.reference_dtype)))
    return result
