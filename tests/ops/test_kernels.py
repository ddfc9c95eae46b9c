"""graphpass.kernels: the generated Triton kernels, run by Triton's interpreter on the CPU.

Each row-local form graphpass extracts (`kernel_programs`) is split as the op splits it
(`JointSplit`), its forward and backward graphs generated, and run: every output and the logits'
gradient must be as close to float64 as eager's, within twice eager's error (plus an ulp of the
output's dtype). What the generator does not express must say why. The interpreter holds bf16 as
raw bits and truncates casts to it; `_interpreter` patches the cast for these tests only.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.workloads import kernel_programs as kp
from graphpass.ops.joint import ArgSpec, JointSplit

triton = pytest.importorskip("triton")

from graphpass.kernels import NotGenerated, unavailable  # noqa: E402
from graphpass.kernels.rowwise import Blocks, GeneratedKernel  # noqa: E402

# Few, large blocks (the interpreter's cost is per program and loop step), not multiples of the shapes.
BLOCKS = Blocks(rows=4, columns=256, warps=4)


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """Triton's interpreter (`TRITON_INTERPRET=1`, set by `conftest` before Triton is imported), its
    fp32 -> bf16 casts rounded as on a GPU (`kp.rounded_bf16_casts`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET is not 1)")
    with kp.rounded_bf16_casts():
        yield


def _split(name: str, args: list, vocab: int, keeps=None) -> tuple[JointSplit, int]:
    return kp.split(name, args, keeps)


def _reference(name: str, args: list, compute, grad_outputs, active) -> tuple[list, torch.Tensor]:
    """The program's outputs and the logits' gradient by autograd, computing in `compute` (its
    floating inputs in float64 too when `compute` is)."""
    module = kp.program_class(name)(compute)
    if compute == torch.float64:
        args = [a.double() if a.is_floating_point() else a for a in args]
    logits = args[0].detach().clone().requires_grad_(True)
    outs = module(logits, *args[1:])
    torch.autograd.backward([outs[j] for j in active], [g.to(outs[j].dtype) for j, g in zip(active, grad_outputs)])
    return [o.detach() for o in outs], logits.grad


def _error(value, exact) -> float:
    """The largest difference, where float64 has a number (NaN where it has NaN is checked apart)."""
    return (value.double() - exact).nan_to_num(0.0).abs().max().item()


def _within_eager(name, ours, eager, exact, dtype):
    assert torch.equal(ours.isnan(), exact.isnan()), name  # NaN exactly where float64 has NaN
    bound = 2 * _error(eager, exact) + torch.finfo(dtype).eps * max(exact.nan_to_num(0.0).abs().max().item(), 1.0)
    assert _error(ours, exact) <= bound, (name, _error(ours, exact), _error(eager, exact))


CASES = [(name, dtype, rows, vocab) for name in kp.NAMES for dtype in (torch.float32, torch.bfloat16)
         for rows, vocab in ((7, 1000), (1, 300))]


@pytest.mark.parametrize("name,dtype,rows,vocab", CASES)
def test_generated_kernels_are_as_close_to_float64_as_eager(name, dtype, rows, vocab):
    generator = torch.Generator().manual_seed(0)
    args = kp.arguments(name, rows, vocab, dtype, generator)
    split, n = _split(name, args, vocab)
    active = tuple(range(n))
    forward = GeneratedKernel(split.forward, "forward", BLOCKS)
    backward = GeneratedKernel(split.backward(active, (0,)), "backward", BLOCKS)
    results = forward(*args)
    outs, saved = results[:n], results[n:]
    grad_outputs = [torch.randn(rows, 1, generator=generator) for _ in active]
    gradient = torch.empty_like(args[0])
    assert backward(*args, *saved, *grad_outputs, gradient) == ()
    eager_outs, eager_grad = _reference(name, args, torch.float32, grad_outputs, active)
    exact_outs, exact_grad = _reference(name, args, torch.float64, grad_outputs, active)
    for ours, eager, exact in zip(outs, eager_outs, exact_outs):
        assert ours.dtype == eager.dtype and ours.shape == eager.shape
        _within_eager(name, ours, eager, exact, ours.dtype)
    assert gradient.dtype == dtype
    _within_eager(name, gradient, eager_grad, exact_grad, dtype)


def test_an_entropy_without_gradient_is_computed_but_not_differentiated():
    generator = torch.Generator().manual_seed(1)
    args = kp.arguments("LogProbEntropy", 5, 700, torch.float32, generator)
    split, n = _split("LogProbEntropy", args, 700, keeps=[0])
    results = GeneratedKernel(split.forward, "forward", BLOCKS)(*args)
    grad = torch.randn(5, 1, generator=generator)
    gradient = torch.empty_like(args[0])
    GeneratedKernel(split.backward((0,), (0,)), "backward", BLOCKS)(*args, *results[n:], grad, gradient)
    eager_outs, eager_grad = _reference("LogProbEntropy", args, torch.float32, [grad], (0,))
    exact_outs, exact_grad = _reference("LogProbEntropy", args, torch.float64, [grad], (0,))
    for ours, eager, exact in zip(results[:n], eager_outs, exact_outs):
        _within_eager("entropy", ours, eager, exact, torch.float32)
    _within_eager("entropy", gradient, eager_grad, exact_grad, torch.float32)


def test_rows_that_are_all_minus_infinity_or_nan_give_what_eager_gives():
    """A row of -inf (log-sum-exp -inf, log-prob NaN) and a row with a NaN: NaN where eager has NaN,
    the same infinities elsewhere; the other rows unchanged."""
    args = kp.arguments("LogProb", 4, 600, torch.float32, torch.Generator().manual_seed(2))
    args[0][1] = -float("inf")
    args[0][2, 17] = float("nan")
    args[0][3, :300] = -float("inf")  # the first block's max is -inf, the row's is not
    split, n = _split("LogProb", args, 600)
    ours = GeneratedKernel(split.forward, "forward", BLOCKS)(*args)
    eager = split.forward(*args)
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, equal_nan=True)


class _Cubed(torch.nn.Module):
    def forward(self, logits):
        return (logits.pow(3).sum(-1, keepdim=True),)


class _MaxOfLogSoftmax(torch.nn.Module):
    def forward(self, logits):
        return (torch.log_softmax(logits, -1).amax(-1, keepdim=True),)


class _ArgMax(torch.nn.Module):
    def forward(self, logits):
        return (torch.log_softmax(logits, -1).argmax(-1, keepdim=True).float() * logits.amax(-1, keepdim=True),)


@pytest.mark.parametrize("module,reason", [(_Cubed(), "pow with exponent 3"), (_ArgMax(), "argmax"),
                                           (_MaxOfLogSoftmax(), "3 sweeps")])
def test_what_the_generator_does_not_express_says_why(module, reason):
    split = JointSplit(torch.fx.symbolic_trace(module), [ArgSpec((3, 50), torch.float32, True, True)], [0], [0],
                       device="cpu")
    with pytest.raises(NotGenerated, match=reason):
        GeneratedKernel(split.forward, "forward")


def test_sums_along_the_row_in_backward_sweep_the_row_twice():
    """The KL's backward sums its incoming gradient along the row (the teacher's probabilities times
    the seed) before it writes: one program per rows, two sweeps, not 2-D tiles."""
    args = kp.arguments("TeacherKL", 3, 50, torch.float32, torch.Generator().manual_seed(3))
    split, n = _split("TeacherKL", args, 50)
    assert not GeneratedKernel(split.backward((0,), (0,)), "backward").tiled
    assert GeneratedKernel(_split("LogProb", args[:1] + [torch.zeros(3, 1, dtype=torch.int64)], 50)[0]
                           .backward((0,), (0,)), "backward").tiled


def test_gradients_summed_over_rows_are_not_generated():
    specs = [ArgSpec((3, 50), torch.float32, True, True), ArgSpec((3, 1), torch.int64, True, False),
             ArgSpec((), torch.float32, False, False)]
    split = JointSplit(torch.fx.symbolic_trace(kp.LogProbEntropy()), specs, [0, 1], [0, 2], device="cpu")
    # The temperature's gradient: a sum over the row and the rows.
    with pytest.raises(NotGenerated, match="sum"):
        GeneratedKernel(split.backward((0, 1), (0, 2)), "backward")
    with pytest.raises(NotGenerated, match="sum"):
        GeneratedKernel(split.fused((0, 1), (0, 2)), "fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_column_tile_kernel_writes_the_gradient_of_its_columns(dtype):
    """The lm_head's second pass (`JointSplit.column_tile`): the backward on columns [start, stop) of
    the logits, its offset read at run time, the tile's gradient as the whole backward's columns, bit
    for bit."""
    generator = torch.Generator().manual_seed(9)
    args = kp.arguments("LogProbEntropy", 6, 700, dtype, generator)
    split, n = _split("LogProbEntropy", args, 700)
    active = tuple(range(n))
    saved = split.forward(*args)[n:]
    grads = [torch.randn(6, 1, generator=generator) for _ in active]
    whole = torch.empty_like(args[0])  # the generated backward over all columns: the same arithmetic
    GeneratedKernel(split.backward(active, (0,)), "backward", BLOCKS)(*args, *saved, *grads, whole)
    kernel = GeneratedKernel(split.column_tile(active, (0,)), "column_tile", BLOCKS)
    for start, stop in ((0, 256), (300, 651), (651, 700)):
        tile = torch.empty(6, stop - start, dtype=dtype)
        kernel(args[0][:, start:stop], *args[1:], *saved, *grads, tile, torch.tensor(start))
        torch.testing.assert_close(tile, whole[:, start:stop], rtol=0, atol=0)


def test_generated_kernels_run_on_cuda_only_with_triton_and_the_switch_on():
    assert unavailable(torch.device("cpu"), True) == "the device is cpu, not CUDA"
    assert "turned off" in unavailable(torch.device("cuda"), False)
    assert unavailable(torch.device("cuda"), True) is None  # triton is importable here


# Each program's kernels for Hopper; two programs' (one swept, one tiled backward) for Blackwell too.
_CROSS_COMPILE = ("from bench.workloads import kernel_programs as kp; import json; "
                  "print(json.dumps(kp.cross_compiled(archs=(90,)) + "
                  "kp.cross_compiled(['LogProbEntropy', 'TeacherKL'], archs=(100,)) + "
                  "kp.cross_compiled(['LogProbEntropy'], kinds=('fused', 'column_tile', 'split'))))")
# Triton version -> kernels that spill there. 3.6: a where(column == index, g, 0) summed along the row beside
# other terms, in a kernel that sweeps the row twice, keeps a 5-10 KB stack frame at every block tried
# (1-2 x 1024-2048 columns); 3.8 compiles it without. Slower, not wrong.
_KNOWN_SPILLS = {"3.6": {("LabelSmoothing", "backward")}}


def test_generated_kernels_compile_for_hopper_and_blackwell_without_spills():
    """Every program's forward and backward, at the GPU's blocks and a 151936-wide bf16 row, compiles
    for sm_90 (two for sm_100; a fused and a column-tile kernel for both) with Triton's bundled
    compiler, in a process whose interpreter is off: no stack frame (no spills), shared memory within
    227 KB."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", _CROSS_COMPILE], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(r["program"], r["kind"], r["arch"]) for r in rows} == (
        {(name, kind, 90) for name in kp.NAMES for kind in ("forward", "backward")}
        | {(name, kind, 100) for name in ("LogProbEntropy", "TeacherKL") for kind in ("forward", "backward")}
        | {("LogProbEntropy", kind, arch) for kind in ("fused", "column_tile", "split_partial", "split_combine")
           for arch in (90, 100)})
    for r in rows:
        assert r["registers"] > 0 and r["shared"] <= 227 * 1024, r
        known = (r["program"], r["kind"]) in _KNOWN_SPILLS.get(".".join(triton.__version__.split(".")[:2]), ())
        assert (r["stack"] > 0) == known, r  # a known spill that is gone must leave the list


def _ppo_terms(logits, targets, mask):
    """Per-token log-prob at temperature 0.7, masked, and the entropy, as RL code writes them."""
    logp = torch.log_softmax(logits.float() / 0.7, -1)
    token = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp.exp() * logp).sum(-1)
    return token, entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_runs_generated_kernels_where_they_are_available(monkeypatch, dtype):
    """Through torch.compile, with generated kernels made available on the CPU (they run in the
    interpreter): the op's forward and backward run them, chunk by chunk, with its calling
    convention (views of the logits, out slices), and give eager's values and gradients."""
    import graphpass
    from graphpass import kernels
    from graphpass.ops import chunked_op

    as_if_cuda = kernels.unavailable
    monkeypatch.setattr(kernels, "unavailable", lambda device, enabled: as_if_cuda(torch.device("cuda"), enabled))
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 5, 300, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, 300, (2, 5), generator=generator)
    mask = (torch.rand(2, 5, generator=generator) > 0.2).float()
    seeds = torch.randn(2, 2, 5, generator=generator)
    results = {}
    for name, generated in (("generated", True), ("inner", False)):
        backend = graphpass.Backend(chunk_size=4, inner="aot_eager", strict=True, generated_kernels=generated)
        x = logits.clone().requires_grad_(True)
        token, entropy = torch.compile(_ppo_terms, backend=backend)(x, targets, mask)
        torch.autograd.backward([token, entropy], list(seeds))
        program = chunked_op.program(backend.records[0].sites[0].program_key)
        results[name] = (token, entropy, x.grad, program)
    token, entropy, grad, program = results["generated"]
    assert "forward" not in program.kernel_notes and "backward" not in program.kernel_notes, program.kernel_notes
    assert isinstance(program._forward_kernel, kernels.rowwise.GeneratedKernel)
    assert results["inner"][3].kernel_notes["forward"] == "turned off (Config.generated_kernels=False)"
    x = logits.clone().requires_grad_(True)
    eager_token, eager_entropy = _ppo_terms(x, targets, mask)
    torch.autograd.backward([eager_token, eager_entropy], list(seeds))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(token, eager_token, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, eager_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, **tolerance)
    torch.testing.assert_close(grad, results["inner"][2], **tolerance)


def test_without_a_chunk_size_a_generated_kernel_runs_once_over_all_rows(monkeypatch):
    """A generated kernel allocates nothing wide: with no chunk size configured, the op calls it once
    per direction (one launch), not once per chunk."""
    import graphpass
    from graphpass import kernels

    as_if_cuda = kernels.unavailable
    monkeypatch.setattr(kernels, "unavailable", lambda device, enabled: as_if_cuda(torch.device("cuda"), enabled))
    calls = []
    run = kernels.rowwise.GeneratedKernel.__call__
    monkeypatch.setattr(kernels.rowwise.GeneratedKernel, "__call__",
                        lambda self, *args: calls.append((self.kind, args[self.wide].shape[0])) or run(self, *args))
    generator = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 7, 200, generator=generator) * 3).requires_grad_(True)
    targets = torch.randint(0, 200, (3, 7), generator=generator)
    backend = graphpass.Backend(inner="aot_eager", strict=True, chunk_budget_bytes=4 * 200 * 4)
    token, entropy = torch.compile(_ppo_terms, backend=backend)(logits, targets, torch.ones(3, 7))
    (token.sum() + entropy.sum()).backward()
    # Each first compiled and run on 16 rows of zeros (`compile_now`), then once over all 21 rows.
    assert calls == [("forward", 16), ("forward", 21), ("backward", 16), ("backward", 21)]


@pytest.mark.parametrize("name", ["LogProbEntropy", "TeacherKL", "SoftCapped"])
def test_the_gradient_made_in_forward_is_as_close_to_float64_as_eager(name):
    """K2f (`JointSplit.fused`): outputs and the logits' gradient in one kernel, given the outputs'
    gradients up front, as `forward_with_gradients` runs it."""
    generator = torch.Generator().manual_seed(7)
    args = kp.arguments(name, 5, 700, torch.bfloat16, generator)
    split, n = _split(name, args, 700)
    active = tuple(range(n))
    fused = GeneratedKernel(split.fused(active, (0,)), "fused", BLOCKS)
    grad_outputs = [torch.randn(5, 1, generator=generator) for _ in active]
    gradient = torch.empty_like(args[0])
    outs = fused(*args, *grad_outputs, gradient)
    eager_outs, eager_grad = _reference(name, args, torch.float32, grad_outputs, active)
    exact_outs, exact_grad = _reference(name, args, torch.float64, grad_outputs, active)
    assert len(outs) == n
    for ours, eager, exact in zip(outs, eager_outs, exact_outs):
        _within_eager(name, ours, eager, exact, ours.dtype)
    _within_eager(name, gradient, eager_grad, exact_grad, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_lm_head_loss_makes_its_gradient_in_forward_with_the_generated_fused_kernel(monkeypatch, dtype):
    """A loss summed over tokens from hidden states: the op computes each row block's logits and, with
    the generated K2f, their gradient in the forward (`forward_with_gradients`); values and the hidden
    states' and weight's gradients match eager's. With a bf16 weight the fused kernel also writes the
    row values a second pass over vocabulary tiles reads (`fused_saving`)."""
    import graphpass
    from graphpass import kernels
    from graphpass.ops import chunked_op

    as_if_cuda = kernels.unavailable
    monkeypatch.setattr(kernels, "unavailable", lambda device, enabled: as_if_cuda(torch.device("cuda"), enabled))
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 6, 16, generator=generator).to(dtype)
    weight = (torch.randn(300, 16, generator=generator) * 0.3).to(dtype)
    targets = torch.randint(0, 300, (2, 6), generator=generator)
    mask = (torch.rand(2, 6, generator=generator) > 0.2).float()

    def loss(hidden, weight, targets, mask):
        token, entropy = _ppo_terms(hidden @ weight.T, targets, mask)
        return -(token.sum() + 0.01 * entropy.sum()) / mask.sum()

    backend = graphpass.Backend(inner="aot_eager", strict=True)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    value = torch.compile(loss, backend=backend)(h, w, targets, mask)
    value.backward()
    site = backend.records[0].sites[0]
    program = chunked_op.program(site.program_key)
    assert site.lm_head and site.gradients_in_forward
    assert "fused" not in program.kernel_notes, program.kernel_notes
    assert any(k[0] == "fused" and isinstance(v, kernels.rowwise.GeneratedKernel)
               for k, v in program._gradient_kernels.items()), program._gradient_kernels
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    expected = loss(h2, w2, targets, mask)
    expected.backward()
    if dtype == torch.bfloat16:  # the two passes: row blocks, then vocabulary tiles, both generated
        assert program._saving_wanted and "column_tile" not in program.kernel_notes
        assert any(k[0] == "column_tile" and isinstance(v, kernels.rowwise.GeneratedKernel)
                   for k, v in program._gradient_kernels.items()), program._gradient_kernels
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


_SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 20.0, -20.0, 90.0, -90.0, 1e30, -1e30,
            float("inf"), -float("inf"), float("nan")]
_UNARY = {
    "exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "abs": torch.abs,
    "sign": torch.sign, "neg": torch.neg, "square": lambda x: x.pow(2), "pow_half": lambda x: x.pow(0.5),
    "clamp": lambda x: x.clamp(-1.0, 1.0), "clamp_min": lambda x: x.clamp_min(0.25),
    "isnan": lambda x: torch.isnan(x).float(), "isinf": lambda x: torch.isinf(x).float(),
    "bf16": lambda x: x.to(torch.bfloat16).float(), "fp16": lambda x: x.to(torch.float16).float(),
    "scaled_bf16": lambda x: (x.to(torch.bfloat16) * 3).float(),
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "where": lambda x, y: torch.where(x > y, x, y),
    "masked_fill": lambda x, y: x.masked_fill(y < 0, -3.0), "compare": lambda x, y: ((x < y) | (x == y)).float(),
    "logical": lambda x, y: torch.logical_xor(x > 0, y > 0).float(),
}


def _elementwise(f, arity: int) -> torch.fx.GraphModule:
    """The graph `out.copy_(f(x[, y]))` on `[rows, V]` values, rows symbolic."""
    from graphpass import _torch_api

    def graph(*args):
        args[-1].copy_(f(*args[:-1]))
        return ()

    fake_mode, rows = _torch_api.symbolic_rows_mode()
    with fake_mode:
        return _torch_api.trace_decomposed(graph, [torch.empty(rows, len(_SPECIAL) ** 2) for _ in range(arity + 1)])


@pytest.mark.parametrize("name", list(_UNARY) + list(_BINARY))
def test_each_emitted_op_gives_torchs_value_on_special_values_too(name):
    """Each op of the emitter's table, on zeros of both signs, tiny and huge values, infinities and NaN:
    the value torch computes (NaN where it does), to a few ulp (accurate tanh, expm1, log1p without
    libdevice), bf16 and fp16 casts rounded as torch rounds."""
    values = torch.tensor(_SPECIAL)
    x = values.repeat_interleave(len(_SPECIAL))[None, :].repeat(2, 1)
    y = values.repeat(len(_SPECIAL))[None, :].repeat(2, 1)
    f, inputs = (_UNARY[name], [x]) if name in _UNARY else (_BINARY[name], [x, y])
    out = torch.empty_like(x)
    GeneratedKernel(_elementwise(f, len(inputs)), "backward", BLOCKS)(*inputs, out)
    torch.testing.assert_close(out, f(*inputs), rtol=4e-7, atol=1e-37, equal_nan=True)


def test_a_kernel_triton_cannot_compile_leaves_the_inner_compilers_kernel(monkeypatch):
    """A generated kernel is compiled and run once on zeros when it is made: a failure there (here a
    stand-in for Triton's) keeps the inner compiler's kernel, the reason recorded, never a failing op."""
    import graphpass
    from graphpass import kernels
    from graphpass.ops import chunked_op

    as_if_cuda = kernels.unavailable
    monkeypatch.setattr(kernels, "unavailable", lambda device, enabled: as_if_cuda(torch.device("cuda"), enabled))

    def fails(self, device, rows=16):
        raise RuntimeError("PTXAS error: a stand-in")

    monkeypatch.setattr(kernels.rowwise.GeneratedKernel, "compile_now", fails)
    logits = torch.randn(3, 7, 200).requires_grad_(True)
    targets = torch.randint(0, 200, (3, 7))
    backend = graphpass.Backend(inner="aot_eager", strict=True)
    token, entropy = torch.compile(_ppo_terms, backend=backend)(logits, targets, torch.ones(3, 7))
    (token.sum() + entropy.sum()).backward()
    program = chunked_op.program(backend.records[0].sites[0].program_key)
    assert program.kernel_notes["forward"] == ("Triton could not compile or run it: "
                                               "RuntimeError: PTXAS error: a stand-in")
    assert "PTXAS" in program.kernel_notes["backward"]
    expected = logits.detach().clone().requires_grad_(True)
    eager_token, eager_entropy = _ppo_terms(expected, targets, torch.ones(3, 7))
    (eager_token.sum() + eager_entropy.sum()).backward()
    torch.testing.assert_close(logits.grad, expected.grad)


def test_float64_logits_are_not_generated():
    """The kernels compute in fp32: a float64 row is the inner compiler's, never silently rounded."""
    args = kp.arguments("LogProb", 3, 50, torch.float32, torch.Generator().manual_seed(10))
    args[0] = args[0].double()
    split, n = _split("LogProb", args, 50)
    with pytest.raises(NotGenerated, match="float64"):
        GeneratedKernel(split.forward, "forward")
    with pytest.raises(NotGenerated, match="float64"):
        GeneratedKernel(split.backward((0,), (0,)), "backward")


class _MaskedMass(kp.Program):
    """The probability mass and the mean logit over allowed columns, about the row's max: online sums
    under a `where`, beside a plain one."""

    def forward(self, logits, allowed):
        x = logits.to(self.compute)
        e = torch.exp(x - x.amax(-1, keepdim=True))
        mass = torch.where(allowed, e, 0).sum(-1, keepdim=True) / e.sum(-1, keepdim=True)
        shifted = torch.where(allowed, e * (x - x.amax(-1, keepdim=True)), 0).sum(-1, keepdim=True)
        return mass, shifted, torch.where(allowed, x, 0).sum(-1, keepdim=True)


def test_online_sums_under_a_mask_take_one_sweep_and_match_float64():
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 600, generator=generator) * 3
    logits[1, :250] = -float("inf")  # a first block with no finite value
    allowed = torch.rand(1, 600, generator=generator) > 0.3
    split = JointSplit(torch.fx.symbolic_trace(_MaskedMass()), [ArgSpec((5, 600), torch.float32, True, True),
                                                                 ArgSpec((1, 600), torch.bool, False, False)],
                       [], [], device="cpu")
    kernel = GeneratedKernel(split.forward, "forward", BLOCKS)
    assert kernel.source.count("for start in range(0, V, BV):") == 1  # one read of each row
    ours = kernel(logits, allowed)
    exact = _MaskedMass(torch.float64)(logits.double(), allowed)
    eager = _MaskedMass()(logits, allowed)
    for o, e, x in zip(ours, eager, exact):
        _within_eager("masked mass", o, e, x.double(), torch.float32)


@pytest.mark.parametrize("name,splits", [("LogProbEntropy", 3), ("LogProb", 4), ("SoftCapped", 2)])
def test_vocabulary_splits_merge_to_the_one_sweep_result(name, splits):
    """K1 over vocabulary splits (each split's state, then their merge in a fixed order): the same
    outputs as one sweep to rounding, within 2x eager's error of float64, NaN rows as eager's."""
    generator = torch.Generator().manual_seed(12)
    args = kp.arguments(name, 6, 1000, torch.bfloat16, generator)
    args[0][2, :600] = -float("inf")  # a whole split with no finite value
    args[0][4] = -float("inf")  # a row with none: NaN, as eager
    split, n = _split(name, args, 1000)
    kernel = GeneratedKernel(split.forward, "forward", BLOCKS)
    assert kernel.states > 0
    whole = kernel(*args)
    kernel.splits = splits
    parts = kernel(*args)
    eager, exact = kp.program_class(name)()(*args), kp.program_class(name)(torch.float64)(
        *[a.double() if a.is_floating_point() else a for a in args])
    for one, merged, e, x in zip(whole, parts, eager, exact):
        torch.testing.assert_close(merged, one, rtol=1e-6, atol=1e-6, equal_nan=True)
        _within_eager(name, merged, e, x, torch.float32)
    for one, merged in zip(whole[n:], parts[n:]):  # the saved row statistics too
        torch.testing.assert_close(merged, one, rtol=1e-6, atol=1e-6, equal_nan=True)
