"""graphpass.ops.joint and graphpass.ops.peephole: the per-chunk kernels, checked on tiny programs.

The forward must save only narrow row statistics, the backward must not redo the forward's
reductions, and both graphs together must give the same values and gradients as autograd
on the program itself.
"""

from __future__ import annotations

import pytest
import torch

from graphpass.ops import joint
from graphpass.ops.joint import ArgSpec, JointSplit

aten = torch.ops.aten
V = 50


class LogprobEntropy(torch.nn.Module):
    """log-prob of the picked token and entropy, at a temperature, from bf16/fp32 logits."""

    def forward(self, logits, index):
        logp = torch.log_softmax(logits.float() / 0.7, -1)
        return logp.gather(-1, index), -(logp.exp() * logp).sum(-1, keepdim=True)


class ScaledLogsumexp(torch.nn.Module):
    """A broadcast [1, V] weight and a 0-d scale that need gradients too."""

    def forward(self, logits, weight, scale):
        return (torch.logsumexp(logits * weight, -1, keepdim=True) * scale,)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _split(module, args, keeps=None):
    specs = [ArgSpec(tuple(a.shape), a.dtype, per_row=a.ndim == 2 and a.shape[0] != 1,
                     wide=a.ndim == 2 and a.shape[-1] == V and a.shape[0] != 1) for a in args]
    outs = module(*args)
    keeps = range(len(outs)) if keeps is None else keeps
    return JointSplit(torch.fx.symbolic_trace(module), specs, list(keeps),
                      [i for i, a in enumerate(args) if a.dtype.is_floating_point], device=args[0].device)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run_split(split, args, grad_outputs, active, wanted):
    """Forward then backward graphs, eagerly; per-row gradients come back through out slices."""
    results = split.forward(*args)
    outs, saved = results[:split.n_outputs], results[split.n_outputs:]
    slices = {i: torch.empty_like(args[i]) for i in wanted if split.args[i].per_row}
    summed = iter(split.backward(active, wanted)(*args, *saved, *grad_outputs, *slices.values()))
    return outs, saved, [slices[i] if i in slices else next(summed) for i in wanted]


def test_forward_saves_row_statistics_and_backward_does_not_reduce_them_again():
    args = [torch.randn(6, V), torch.randint(0, V, (6, 1))]
    split = _split(LogprobEntropy(), args)
    # The row max, the log-sum-exp and the sums the entropy's gradient reads (`row_sums`).
    assert split.saved and all(s.tail == (1,) for s in split.saved)
    for active in ((0,), (0, 1)):
        backward = split.backward(active, (0,))
        assert aten.amax.default not in _targets(backward)
        assert aten.log.default not in _targets(backward)
        # One pass: read the logits, write the gradient; no sum over the row left.
        assert aten.sum.dim_IntList not in _targets(backward)


def test_the_forward_sums_each_row_in_one_pass_after_its_max():
    """The entropy's sum needs the log-sum-exp once its row constants are out (`row_sums`): every
    forward row sum depends on the max only, so they all run in one pass after it."""
    args = [torch.randn(6, V), torch.randint(0, V, (6, 1))]
    forward = _split(LogprobEntropy(), args).forward
    sums = [n for n in forward.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 2
    for node in sums:
        assert not any(a.target is aten.sum.dim_IntList for a in ancestors(node))


@pytest.mark.parametrize("active", [(0,), (1,), (0, 1)])
def test_the_fused_kernel_matches_autograd(active):
    """`JointSplit.fused`: forward and backward in one graph, as a gradient known in forward runs."""
    logits, index = torch.randn(7, V), torch.randint(0, V, (7, 1))
    module = LogprobEntropy()
    fused = _split(module, [logits, index]).fused(active, (0,))
    grad_outputs = [torch.randn(7, 1) for _ in active]
    grad = torch.empty_like(logits)
    outs = fused(logits, index, *grad_outputs, grad)
    _, vjp = torch.func.vjp(lambda x: tuple(module(x, index)[j] for j in active), logits)
    for out, ref in zip(outs, module(logits, index)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, vjp(tuple(grad_outputs))[0], atol=1e-5, rtol=1e-5)


def test_common_subexpressions_are_merged_in_functional_graphs_only():
    from graphpass.ops.row_sums import merge_common_subexpressions

    def program(x):
        y = torch.ops.aten.exp.default(x)
        torch.ops.aten.add_.Tensor(x, 1.0)  # x changed: the second exp(x) is another value
        return y, torch.ops.aten.exp.default(x)

    gm = torch.fx.symbolic_trace(program)
    with pytest.raises(ValueError, match="in-place"):
        merge_common_subexpressions(gm.graph)


def test_gather_reads_the_input_and_its_backward_is_a_select():
    args = [torch.randn(6, V), torch.randint(0, V, (6, 1))]
    split = _split(LogprobEntropy(), args)
    gathers = [n for n in split.forward.graph.nodes if n.target is aten.gather.default]
    assert len(gathers) == 1 and gathers[0].args[0].op == "placeholder"
    backward = _targets(split.backward((0, 1), (0,)))
    assert aten.scatter_add.default not in backward and aten.where.ScalarOther in backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("active", [(0,), (1,), (0, 1)])
def test_split_matches_autograd(dtype, active):
    logits = torch.randn(7, V).to(dtype)
    logits[2, :10] = float("-inf")  # a top-p style mask
    index = torch.randint(10, V, (7, 1))
    module = LogprobEntropy()
    split = _split(module, [logits, index])
    grad_outputs = [torch.randn(7, 1) for _ in active]
    outs, _, grads = _run_split(split, [logits, index], grad_outputs, active, (0,))

    ref_outs = module(logits, index)
    # Only the active outputs are differentiated, as autograd does for a loss that uses only them
    # (a zero cotangent through a masked row's nan entropy would make the gradient nan).
    _, vjp = torch.func.vjp(lambda x: tuple(module(x, index)[j] for j in active), logits)
    ref_grad, = vjp(tuple(grad_outputs))
    # A masked row's entropy is nan in eager too (0 * -inf), so nan must match nan.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    tol["equal_nan"] = True
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, **tol)
    assert grads[0].dtype == dtype
    torch.testing.assert_close(grads[0], ref_grad, **tol)


def test_broadcast_and_scalar_inputs_get_summed_gradients():
    args = [torch.randn(5, V), torch.rand(1, V) + 0.5, torch.tensor(1.5, dtype=torch.float64)]
    module = ScaledLogsumexp()
    split = _split(module, args)
    grad_output = torch.randn(5, 1)
    outs, _, grads = _run_split(split, args, [grad_output], (0,), (0, 1, 2))

    ref_outs, vjp = torch.func.vjp(module, *args)
    for got, ref in zip([*outs, *grads], [*ref_outs, *vjp((grad_output,))]):
        # The broadcast gradients are sums over rows, in another order than autograd's.
        torch.testing.assert_close(got, ref.to(got.dtype), atol=1e-5, rtol=1e-4)


def test_kernels_are_generic_in_the_row_count():
    args = [torch.randn(6, V), torch.randint(0, V, (6, 1))]
    split = _split(LogprobEntropy(), args)
    for rows in (1, 3, 11):
        x, index = torch.randn(rows, V), torch.randint(0, V, (rows, 1))
        outs, saved, _ = _run_split(split, [x, index], [torch.ones(rows, 1)], (0,), (0,))
        assert outs[0].shape == (rows, 1) and all(s.shape == (rows, 1) for s in saved)
        torch.testing.assert_close(outs[0], LogprobEntropy()(x, index)[0])


class ForwardKL(torch.nn.Module):
    """KL(teacher || student) per row: the log-softmax's backward sums the teacher's probabilities
    along each row, a reduction no forward statistic gives."""

    def forward(self, student, teacher):
        sl = torch.log_softmax(student, -1)
        tl = torch.log_softmax(teacher, -1).detach()
        return ((tl.exp() * (tl - sl)).sum(-1, keepdim=True),)


def test_a_backward_in_two_kernels_carries_its_row_sums():
    """`backward_in_two`: the row reductions first (`carried`), then the rest, which reads them and
    reduces nothing along the row: the same gradient as the one kernel and as autograd; the
    column-tile kernel reads the same carried values."""
    student, teacher = torch.randn(7, V), torch.randn(7, V)
    split = _split(ForwardKL(), [student, teacher])
    split = JointSplit(split.program, split.args, [0], [0], device=student.device)
    (carried,) = split.carried((0,), (0,))
    assert carried.tail == (1,)
    saved = split.forward(student, teacher)[1:]
    grad_out = torch.randn(7, 1)
    one = torch.empty_like(student)
    split.backward((0,), (0,))(student, teacher, *saved, grad_out, one)
    reductions, rest = split.backward_in_two((0,), (0,))
    assert aten.sum.dim_IntList not in _targets(rest)
    sums = reductions(student, teacher, *saved, grad_out, torch.empty_like(student))
    two = torch.empty_like(student)
    rest(student, teacher, *saved, grad_out, *sums, two)
    _, vjp = torch.func.vjp(lambda s: ForwardKL()(s, teacher)[0], student)
    torch.testing.assert_close(one, vjp(grad_out)[0])
    torch.testing.assert_close(two, one)
    tile = split.column_tile((0,), (0,))
    columns = slice(20, 35)
    out = torch.empty(7, 15)
    tile(student[:, columns], teacher[:, columns], *saved, grad_out, *sums, out, torch.tensor(20))
    torch.testing.assert_close(out, one[:, columns])


def test_a_kernel_the_compiler_fails_on_runs_its_fallback_or_uncompiled(graphpass_log):
    """A per-chunk kernel the inner compiler cannot compile (inductor's pytorch/pytorch#196570
    on some in-place row kernels) must still run, often in a backward that cannot fall back:
    its fallback where one is given, else its own graph, op by op; either way the same values."""
    from graphpass import _torch_api

    def failing(gm, example_inputs):
        raise RuntimeError("this compiler compiles nothing")

    graph = torch.fx.symbolic_trace(lambda x: (torch.softmax(x, -1) * 2,))
    x = torch.randn(4, V)
    expected = graph(x)[0]
    uncompiled = _torch_api.compile_kernel(graph, failing)
    torch.testing.assert_close(uncompiled(x)[0], expected)
    torch.testing.assert_close(uncompiled(x)[0], expected)  # no second attempt
    calls = []
    with_fallback = _torch_api.compile_kernel(graph, failing, fallback=lambda: calls.append(1) or graph)
    torch.testing.assert_close(with_fallback(x)[0], expected)
    torch.testing.assert_close(with_fallback(x)[0], expected)
    assert calls == [1]
    messages = graphpass_log
    assert sum("runs uncompiled" in m and "compiles nothing" in m for m in messages) == 1, messages
    assert sum("its fallback runs instead" in m for m in messages) == 1, messages


def test_a_scatter_into_zeros_becomes_a_select_only_where_it_writes_one_entry_per_row():
    """`scatter(zeros, -1, idx, -1.0)` (nll_loss's backward) and a `[rows, 1]` src become
    `where(arange(V) == idx, src, 0)`, and a row sum of the select times a row constant its
    picked value; a src wider than the index (only its first column is written) stays a scatter."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphpass.ops import peephole

    idx = torch.randint(0, V, (6, 1))
    scale, wide = torch.randn(6, 1), torch.randn(6, V)

    def scalar(idx, scale, wide):
        picked = torch.zeros(6, V).scatter(-1, idx, -1.0) * scale
        return picked, picked.sum(-1)

    def wider(idx, scale, wide):
        return (torch.zeros(6, V).scatter(-1, idx, wide),)

    for fn, rewritten in ((scalar, True), (wider, False)):
        gm = make_fx(fn)(idx, scale, wide)
        expected = fn(idx, scale, wide)
        peephole.optimize(gm.graph)
        gm.recompile()
        assert (aten.scatter.value not in _targets(gm) and aten.scatter.src not in _targets(gm)) == rewritten
        if rewritten:
            assert aten.sum.dim_IntList not in _targets(gm)
        for mine, theirs in zip(gm(idx, scale, wide), expected):
            torch.testing.assert_close(mine, theirs)



class Bf16ManualLogprob(torch.nn.Module):
    """A log-prob at a per-row temperature, the softmax written out in bf16 (`bench.fuzz` seed 10323)."""

    def forward(self, logits, temperature, index):
        x = (logits / temperature).to(logits.dtype)
        lp = x - x.amax(-1, keepdim=True)
        lp = lp - lp.exp().sum(-1, keepdim=True).log()
        return (lp.gather(-1, index),)


def test_row_sums_in_bf16_round_as_written(monkeypatch):
    # Factored, each term of a bf16 row sum would be rounded to 8 bits where the user's sum rounds
    # once: the temperature's gradient came out 1.7 x further from float64 than eager's.
    args = [torch.randn(6, V).bfloat16(), 0.5 + torch.rand(6, 1), torch.randint(0, V, (6, 1))]
    grad_outputs = [torch.randn(6, 1).bfloat16()]

    def run():
        split = _split(Bf16ManualLogprob(), args)
        return _run_split(split, args, grad_outputs, (0,), (0, 1))

    as_written = run()
    monkeypatch.setattr(joint.row_sums, "factor_row_sums", lambda gm, gradients=0: False)
    unfactored = run()
    for got, want in zip([*as_written[0], *as_written[2]], [*unfactored[0], *unfactored[2]]):
        assert torch.equal(got, want)


def test_per_chunk_kernels_are_compiled_for_their_rows_on_cuda_only():
    """On CUDA a per-chunk kernel reduces each row in one program and tiles its pointwise kernels
    in 2-D (inductor's 2-row choices split a 151936-wide row 19 ways and read it twice); the CPU
    keeps its options, and with them its speed and memory; other compilers take none."""
    from graphpass import _torch_api

    cpu = _torch_api.kernel_options("inductor", torch.device("cpu"))
    cuda = _torch_api.kernel_options("inductor", torch.device("cuda", 1))
    assert cpu == {"triton.cudagraphs": False}
    assert cuda == {"triton.cudagraphs": False, "split_reductions": False, "triton.prefer_nd_tiling": True}
    assert _torch_api.kernel_options("aot_eager", torch.device("cuda")) is None
    # Each is an option inductor knows (an unknown one fails only when a kernel compiles).
    import torch._inductor.config as inductor_config

    for key in cuda:
        section, _, name = key.rpartition(".")
        assert hasattr(getattr(inductor_config, section) if section else inductor_config, name), key
    # A CPU kernel's first call compiles it with the CPU's options, on a 2-row sample whatever rows are hinted.
    graph = torch.fx.symbolic_trace(lambda x: (torch.softmax(x, -1) * 2,))
    x = torch.randn(4, V)
    kernel = _torch_api.compile_kernel(graph, "inductor", rows=4096)
    torch.testing.assert_close(kernel(x)[0], torch.softmax(x, -1) * 2)
    assert kernel.options == cpu
    assert [a.shape for a in _torch_api._sample_arguments(_traced_with_rows(graph), rows=4096)] == [(2, V)]


def _traced_with_rows(graph):
    """`graph` traced on fakes with symbolic rows (its placeholders' example values)."""
    from graphpass import _torch_api

    fake_mode, rows = _torch_api.symbolic_rows_mode()
    with fake_mode:
        return _torch_api.trace_decomposed(graph, [torch.empty(rows, V)])


def ancestors(node) -> set:
    """Every node `node` reads, directly or not."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
