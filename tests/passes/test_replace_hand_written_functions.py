"""Hand-written one-device log-prob/entropy `autograd.Function`s compiled with graphpass.

Where the forward computes exactly log-probs and/or entropies and the backward is their gradient
(checked on a few float64 rows, `graphpass.analysis.backward_check`), the Function becomes plain
math that the chunk pass rewrites: one site, the lm_head fused when the matmul is in the graph,
values and every input gradient as eager's. Twins whose backward differs (a dropped entropy
gradient, a forgotten temperature, a straight-through estimate, a branch on logits, a gradient for
another input) must run as written, the user's backward kept, with the reason recorded. The same
for Functions that loop over chunks of rows, and for Functions that multiply by the output layer
themselves (read at their logits: `hidden @ W.T`, then the plain math, the lm_head fused).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import graphpass
from tests.helpers import covering_grid, mixed_error

T, V, H = 12, 40, 16


# ---- Functions whose backward is right ------------------------------------------------------------
class _SlimeStyle(torch.autograd.Function):
    """slime's log-prob and entropy without a group: upcast, temperature inside, a scatter_add
    of the target's gradient; `with_entropy` False returns an empty entropy, as slime does."""

    @staticmethod
    def forward(ctx, logits, target, temperature: float, with_entropy: bool):
        x = logits.float() / temperature
        row_max = x.max(dim=-1, keepdim=True).values
        exp = (x - row_max).exp()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        softmax = exp / sum_exp
        lse = row_max + sum_exp.log()
        logprob = (x.gather(-1, target[:, None]) - lse)[:, 0]
        entropy = (lse - (softmax * x).sum(-1, keepdim=True))[:, 0] if with_entropy else logits.new_zeros((0,))
        ctx.save_for_backward(softmax, target, x, lse)
        ctx.temperature, ctx.with_entropy, ctx.dtype = temperature, with_entropy, logits.dtype
        return logprob.to(logits.dtype), entropy.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        softmax, target, x, lse = ctx.saved_tensors
        grad = -softmax * grad_logprob.float()[:, None]
        grad = grad.scatter_add(-1, target[:, None], grad_logprob.float()[:, None])
        if ctx.with_entropy:
            mean_x = (softmax * x).sum(-1, keepdim=True)
            grad = grad + softmax * (mean_x - x) * grad_entropy.float()[:, None]
        return (grad / ctx.temperature).to(ctx.dtype), None, None, None


class _MegatronStyle(torch.autograd.Function):
    """megatron-core's cross-entropy math on one device, no group: the target's logit picked with
    x[arange, t], its gradient written with an index_put."""

    @staticmethod
    def forward(ctx, logits, target):
        row_max = logits.max(dim=-1, keepdim=True).values
        x = logits - row_max
        rows = torch.arange(x.shape[0], device=x.device)
        picked = x[rows, target]
        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        ctx.save_for_backward(exp / sum_exp[:, None], target)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, target] -= 1.0
        return grad * grad_loss[:, None], None


class _OneHotStyle(torch.autograd.Function):
    """Log-probs with a backward through F.one_hot."""

    @staticmethod
    def forward(ctx, logits, target):
        logp = logits.log_softmax(-1)
        ctx.save_for_backward(logp, target)
        return logp.gather(-1, target[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad):
        logp, target = ctx.saved_tensors
        return (F.one_hot(target, logp.shape[-1]).to(logp.dtype) - logp.exp()) * grad[:, None], None


# ---- twins: a backward that is not the gradient ---------------------------------------------------
class _Twin(torch.autograd.Function):
    """The log-prob and entropy with a backward that differs from their gradient by `flaw`."""

    @staticmethod
    def forward(ctx, logits, target, scale, flaw: str):
        x = logits / 2.0
        logp = x.log_softmax(-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1)
        ctx.save_for_backward(p, logp, target, x)
        ctx.flaw = flaw
        return logp.gather(-1, target[:, None])[:, 0], entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        p, logp, target, x = ctx.saved_tensors
        flaw = ctx.flaw
        grad = (F.one_hot(target, p.shape[-1]).to(p.dtype) - p) * grad_logprob[:, None]
        if flaw == "straight-through":
            grad = F.one_hot(target, p.shape[-1]).to(p.dtype) * grad_logprob[:, None]
        entropy = -p * (logp + (-(p * logp).sum(-1, keepdim=True))) * grad_entropy[:, None]
        if flaw != "entropy gradient dropped":
            grad = grad + entropy
        if flaw == "branch on logits":
            grad = torch.where(x > 3.0, torch.zeros_like(grad), grad)
        scale_grad = grad_logprob.sum() if flaw == "gradient for another input" else None
        return grad if flaw == "temperature forgotten" else grad / 2.0, None, scale_grad, None


def _compile(fn, *args, inner="aot_eager"):
    """The compiled value and the record of the graph that ran (Dynamo may trace a frame twice)."""
    backend = graphpass.Backend(inner=inner)
    return torch.compile(fn, backend=backend)(*args), backend.records[-1]


def _three_ways(fn, plain, *tensors):
    """`plain` (the math in float64; None: not run), `fn` eager and `fn` compiled by graphpass,
    each on its own copies of `tensors` and back-propagated: the three copies, the three values,
    the record and the reasons a Function was kept."""
    exact, eager, compiled = ([t.clone().requires_grad_() for t in tensors] for _ in range(3))
    want, got_eager = None if plain is None else plain(*exact), fn(*eager)
    if want is not None:
        want.backward()
    got_eager.backward()
    value, record = _compile(fn, *compiled)
    value.backward()
    reasons = [r.reason for r in record.rejected if "autograd.Function kept" in r.reason]
    return (exact, eager, compiled), (want, got_eager, value), record, reasons


def _loss(logprob, entropy, weights):
    return (logprob * weights[0]).sum() + (entropy * weights[1]).sum() if entropy.numel() else (logprob * weights[0]).sum()


@pytest.mark.parametrize("case", ["slime", "slime, no entropy", "slime, bf16", "megatron", "one_hot"])
def test_a_function_whose_backward_is_the_gradient_becomes_one_site(case):
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if "bf16" in case else torch.float64
    x = (3 * torch.randn(T, V, generator=g, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, V, (T,), generator=g)
    target[0], target[1] = 0, V - 1
    weights = torch.randn(2, T, generator=g, dtype=torch.float64).to(dtype)

    def fn(logits):
        if case.startswith("slime"):
            logprob, entropy = _SlimeStyle.apply(logits, target, 0.7, "no entropy" not in case)
        elif case == "megatron":
            logprob, entropy = -_MegatronStyle.apply(logits, target), logits.new_zeros((0,))
        else:
            logprob, entropy = _OneHotStyle.apply(logits, target), logits.new_zeros((0,))
        return _loss(logprob, entropy, weights)

    def plain(logits):  # the math the Function computes, in float64
        logp = (logits / (0.7 if case.startswith("slime") else 1.0)).log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1) if case in ("slime", "slime, bf16") else logits.new_zeros((0,))
        return _loss(logp.gather(-1, target[:, None])[:, 0], entropy, weights.double())

    exact, eager_x, x = (x.detach().double().requires_grad_(), x.clone().requires_grad_(),
                         x.clone().requires_grad_())
    want, eager = plain(exact), fn(eager_x)
    want.backward()
    eager.backward()
    value, record = _compile(fn, x)
    value.backward()
    assert [s.replaced_function is not None for s in record.sites] == [True], (record.sites, record.rejected)
    # As close to the float64 math as eager's Function (slime's upcast rounds float64 to float32).
    tolerance = {torch.float64: 1e-12, torch.bfloat16: 1e-3}[dtype]
    assert mixed_error(value, want) <= 2 * mixed_error(eager, want) + tolerance
    assert mixed_error(x.grad, exact.grad) <= 2 * mixed_error(eager_x.grad, exact.grad) + tolerance


def test_the_lm_head_before_a_checked_function_is_fused():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (T,), generator=g)
    advantages = torch.randn(T, generator=g, dtype=torch.float64)

    def fn(hidden, weight):
        logprob, entropy = _SlimeStyle.apply(hidden @ weight.T, target, 1.0, True)
        return -(logprob * advantages).mean() - 0.01 * entropy.mean()

    def plain(hidden, weight):
        logp = (hidden @ weight.T).log_softmax(-1)
        return -(logp.gather(-1, target[:, None])[:, 0] * advantages).mean() \
            + 0.01 * (logp.exp() * logp).sum(-1).mean()

    exact, eager, compiled = ([t.clone().requires_grad_() for t in (hidden, weight)] for _ in range(3))
    want, got_eager = plain(*exact), fn(*eager)
    want.backward()
    got_eager.backward()
    value, record = _compile(fn, *compiled)
    value.backward()
    assert len(record.sites) == 1 and record.sites[0].lm_head, (record.sites, record.rejected)
    # As close to the float64 math as eager's Function (whose upcast rounds to float32).
    assert mixed_error(value, want) <= 2 * mixed_error(got_eager, want) + 1e-12
    for got, ref, exact_t in zip(compiled, eager, exact):
        assert mixed_error(got.grad, exact_t.grad) <= 2 * mixed_error(ref.grad, exact_t.grad) + 1e-12


@pytest.mark.parametrize("flaw", ["none", "entropy gradient dropped", "temperature forgotten", "straight-through",
                                  "branch on logits", "gradient for another input"])
def test_a_backward_that_is_not_the_gradient_is_kept_with_its_reason(flaw):
    g = torch.Generator().manual_seed(2)
    x = 3 * torch.randn(T, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (T,), generator=g)
    weights = torch.randn(2, T, generator=g, dtype=torch.float64)

    def fn(logits, scale):
        logprob, entropy = _Twin.apply(logits, target, scale, flaw)
        return _loss(logprob, entropy, weights) * scale

    eager = [x.clone().requires_grad_(), torch.tensor(1.5, dtype=torch.float64, requires_grad=True)]
    want = fn(*eager)
    want.backward()
    compiled = [t.detach().clone().requires_grad_() for t in eager]
    value, record = _compile(fn, *compiled)
    value.backward()
    # Whatever graphpass decides, the user's gradients are eager's: their backward, as written.
    assert mixed_error(value, want) <= 1e-12
    for got, ref in zip(compiled, eager):
        assert mixed_error(got.grad, ref.grad) <= 1e-12
    reasons = [r.reason for r in record.rejected if "autograd.Function kept" in r.reason]
    if flaw == "none":
        assert [s.replaced_function is not None for s in record.sites] == [True] and reasons == [], record
        return
    assert record.sites == [] and len(reasons) == 1, (record.sites, record.rejected)
    expected = {"branch on logits": "compares float values",
                "gradient for another input": "returns a gradient for its input 3"}.get(
        flaw, "its backward is not the gradient of its forward's math")
    assert expected in reasons[0] and "log-prob and entropy" in reasons[0], reasons[0]


def test_under_inductor_too():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, V, generator=g)
    target = torch.randint(0, V, (T,), generator=g)

    def fn(logits):
        logprob, entropy = _SlimeStyle.apply(logits, target, 0.5, True)
        return logprob.sum() + 0.1 * entropy.sum()

    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    fn(eager_x).backward()
    value, record = _compile(fn, compiled_x, inner="inductor")
    value.backward()
    assert len(record.sites) == 1 and mixed_error(compiled_x.grad, eager_x.grad) <= 1e-5


class _Linear(torch.autograd.Function):
    """A hand-written linear layer: a product of two inputs, normalised nowhere."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def test_a_function_that_is_no_log_prob_is_none_of_its_business():
    # A product of two inputs is an output layer's only where the Function normalises it: a
    # plain linear layer gets no "autograd.Function kept" line (the log-probs after it are found).
    x, w = torch.randn(T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    target = torch.randint(0, V, (T,))

    def fn(x, w):
        return torch.log_softmax(_Linear.apply(x, w), -1).gather(-1, target[:, None]).sum()

    value, record = _compile(fn, x, w)
    value.backward()
    assert not [r for r in record.rejected if "autograd.Function kept" in r.reason], record.rejected
    assert len(record.sites) == 1, record


def _as_torch_2_11_records_it(gm, read_an_intermediate=False):
    """Dynamo's graph of a Function as torch 2.11's Dynamo records it (on 2.11: as it is): every
    tensor the forward body computes after its outputs, a gradient named `unused_<k>` for each in
    the backward body (`_torch_api.drop_function_intermediates`); with `read_an_intermediate`, the
    graph also reads one of them (which 2.11 never does: its outputs could not be told)."""
    apply = torch.ops.higher_order.autograd_function_apply
    for node in list(gm.graph.find_nodes(op="call_function", target=apply)):
        forward, backward = getattr(gm, node.args[0].target), getattr(gm, node.args[1].target)
        output = forward.graph.output_node()
        returned, saved = output.args[0]
        grads = list(backward.graph.find_nodes(op="placeholder"))[:len(returned)]
        if not any(g.name.startswith("unused_") for g in grads):
            extra = [n for n in forward.graph.nodes if n.op == "call_function" and n not in returned
                     and isinstance(n.meta.get("example_value"), torch.Tensor)]
            output.args = ((*returned, *extra), saved),
            forward.recompile()
            with backward.graph.inserting_after(grads[-1]):
                for k in reversed(range(len(extra))):
                    backward.graph.placeholder(f"unused_{k}")
            backward.recompile()
            node.meta["example_value"] = (*node.meta["example_value"], *(n.meta["example_value"] for n in extra))
            returned = output.args[0][0]
        if read_an_intermediate:
            unused = next(i for i, g in enumerate(backward.graph.find_nodes(op="placeholder"))
                          if g.name.startswith("unused_"))
            with gm.graph.inserting_after(node):
                item = gm.graph.call_function(operator.getitem, (node, unused))
            item.meta["example_value"] = returned[unused].meta["example_value"]
            loss = gm.graph.output_node().args[0][0]
            with gm.graph.inserting_before(gm.graph.output_node()):
                total = gm.graph.call_function(torch.add, (loss, gm.graph.call_method("sum", (item,))))
            gm.graph.output_node().args = ((total,),)
    gm.recompile()
    return gm


@pytest.mark.parametrize("read_an_intermediate", [False, True])
def test_a_function_as_torch_2_11_records_it_is_read_as_torch_2_13s(read_an_intermediate):
    """torch 2.11's Dynamo returns a Function's intermediate values among its outputs: the Function
    is read as on 2.13 (the same site, eager's values and gradients); where the graph reads one of those
    values, its outputs cannot be told, and it runs as written with the reason recorded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (T,), generator=g)

    def fn(logits, target):
        logprob, entropy = _SlimeStyle.apply(logits, target, 0.7, True)
        return (logprob * torch.arange(T)).sum() + entropy.sum()

    graphpass_backend = graphpass.Backend(inner="aot_eager")
    seen = []

    def backend(gm, example_inputs):
        gm = _as_torch_2_11_records_it(gm, read_an_intermediate)
        seen.append(gm)
        return graphpass_backend(gm, example_inputs)

    eager_x, x = x.clone().requires_grad_(), x.clone().requires_grad_()
    value = torch.compile(fn, backend=backend)(x, target)
    value.backward()
    record = graphpass_backend.records[-1]
    if read_an_intermediate:  # eager here: the same graph, run as written
        eager = torch.fx.Interpreter(seen[-1]).run(eager_x, target)[0]
        assert record.sites == [] and [r.reason for r in record.rejected] == [
            "autograd.Function kept: Dynamo returns values that are not the Function's outputs with them, "
            "and the graph reads a value Dynamo marks unused"], record
    else:
        eager = fn(eager_x, target)
        _, as_2_13_records_it = _compile(fn, x.detach(), target)
        assert len(record.sites) == 1 and not record.rejected, record
        assert [s.kind for s in record.sites] == [s.kind for s in as_2_13_records_it.sites], record
    eager.backward()
    tolerance = {} if read_an_intermediate else {"rtol": 1e-6, "atol": 1e-6}  # the Function's math is fp32
    torch.testing.assert_close(value, eager, **tolerance)
    torch.testing.assert_close(x.grad, eager_x.grad, **tolerance)


# ---- Functions that loop over chunks of rows -----------------------------------------------------
class _Chunked(torch.autograd.Function):
    """Log-prob and entropy over chunks of `chunk` rows (the last one shorter), each chunk's
    log-sum-exp saved, the backward recomputing each chunk's softmax into a buffer filled chunk by
    chunk; `flaw` names how its backward differs from the gradient."""

    @staticmethod
    def forward(ctx, logits, target, temperature: float, chunk: int, flaw: str):
        logprobs, entropies, lses = [], [], []
        for start in range(0, logits.shape[0], chunk):
            x = logits[start:start + chunk].float() / temperature
            lse = x.logsumexp(-1)
            p = (x - lse[:, None]).exp()
            logprobs.append(x.gather(-1, target[start:start + chunk, None])[:, 0] - lse)
            entropies.append(lse - (p * x).sum(-1))
            lses.append(lse)
        ctx.save_for_backward(logits, target, torch.cat(lses))
        ctx.temperature, ctx.chunk, ctx.flaw = temperature, chunk, flaw
        return torch.cat(logprobs).to(logits.dtype), torch.cat(entropies).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, target, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for k, start in enumerate(range(0, logits.shape[0], ctx.chunk)):
            rows = slice(start, start + ctx.chunk)
            x = logits[rows].float() / ctx.temperature
            p = (x - lse[rows, None]).exp()
            g = -p * grad_logprob[rows, None].float()
            g = g.scatter_add(-1, target[rows, None], grad_logprob[rows, None].float())
            if ctx.flaw != "entropy gradient dropped":
                mean_x = (p * x).sum(-1, keepdim=True)
                g = g + p * (mean_x - x) * grad_entropy[rows, None].float()
            last = start + ctx.chunk >= logits.shape[0]
            divisor = 1.0 if ctx.flaw == "temperature forgotten in the last chunk" and last else ctx.temperature
            grad[rows] = (g / divisor).to(logits.dtype)
        return grad, None, None, None, None


@pytest.mark.parametrize("flaw", ["none", "entropy gradient dropped", "temperature forgotten in the last chunk"])
@pytest.mark.parametrize("chunk", [4, 5, T])
def test_a_chunk_loop_over_rows_is_read_as_one_computation(flaw, chunk):
    """A Function that loops over chunks of rows (Dynamo unrolls the loop) is read as its loop
    folded: one site when its backward is the gradient, float64 values and gradients to 1e-12
    of the plain math; else kept as written, the reason naming what differs."""
    g = torch.Generator().manual_seed(4)
    x = 3 * torch.randn(T, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (T,), generator=g)
    target[0], target[-1] = 0, V - 1
    weights = torch.randn(2, T, generator=g, dtype=torch.float64)

    def fn(logits):
        return _loss(*_Chunked.apply(logits, target, 0.7, chunk, flaw), weights)

    def plain(logits):
        logp = (logits / 0.7).log_softmax(-1)
        return _loss(logp.gather(-1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1), weights)

    ((exact,), (eager_x,), (x,)), (want, eager, value), record, reasons = _three_ways(fn, plain, x)
    if flaw == "none":
        assert [s.replaced_function is not None for s in record.sites] == [True] and reasons == [], record
        # The Function rounds to float32 inside; the plain math graphpass runs does not.
        assert mixed_error(value, want) <= 1e-12 and mixed_error(x.grad, exact.grad) <= 1e-12
        return
    # Kept: the user's backward, as written.
    assert record.sites == [] and len(reasons) == 1, (record.sites, record.rejected)
    assert mixed_error(value, eager) <= 1e-12 and mixed_error(x.grad, eager_x.grad) <= 1e-12
    expected = "not the gradient of its forward's math" if flaw == "entropy gradient dropped" or chunk == T \
        else "not row by row"
    assert expected in reasons[0], reasons[0]


# ---- Functions with an online log-sum-exp over vocabulary blocks --------------------------------
class _OnlineLogSumExp(torch.autograd.Function):
    """Log-prob and entropy as hand-fused kernels compute them (TRL's torch path): the logits a
    block of `block` columns at a time, folded into a running max, sum of exps and sum of
    `exp * x` written in place (rescaled at each block), the target's logit picked from the block
    it falls in. `flaw` names how the Function differs from the math."""

    @staticmethod
    def forward(ctx, logits, target, temperature: float, block: int, flaw: str):
        m = torch.full(logits.shape[:1], float("-inf"), dtype=logits.dtype)
        s, sx, picked = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        for start in range(0, logits.shape[1], block):
            x = logits[:, start:start + block] / temperature
            new_m = torch.maximum(m, x.amax(-1))
            rescale = (m - new_m).exp()
            e = (x - new_m[:, None]).exp()
            s.mul_(rescale if flaw != "sum not rescaled" else 1.0).add_(e.sum(-1))
            sx.mul_(rescale).add_((e * x).sum(-1))
            m.copy_(new_m)
            inside = (target >= start) & (target < start + block)
            at = (target - start).clamp(0, block - 1)[:, None]
            picked.copy_(torch.where(inside, x.gather(-1, at)[:, 0], picked))
        lse = m + s.log()
        entropy = lse - sx / s
        ctx.save_for_backward(logits, target, lse, entropy)
        ctx.temperature, ctx.flaw = temperature, flaw
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, target, lse, entropy = ctx.saved_tensors
        logp = logits / ctx.temperature - lse[:, None]
        p = logp.exp()
        dz = (F.one_hot(target, logits.shape[1]).to(logits.dtype) - p) * grad_logprob[:, None]
        if ctx.flaw != "entropy gradient dropped":
            dz = dz - p * (logp + entropy[:, None]) * grad_entropy[:, None]
        return dz / ctx.temperature, None, None, None, None


@pytest.mark.parametrize("flaw", ["none", "sum not rescaled", "entropy gradient dropped"])
@pytest.mark.parametrize("block", [8, 16, V])
def test_an_online_log_sum_exp_over_vocabulary_blocks_is_read_as_the_log_softmax(flaw, block):
    """Blocks that tile the vocabulary (the last one shorter at 16) fold into the log-sum-exp,
    the entropy and the target's logit of the whole logits: one site when the backward is the
    gradient, float64 values and gradients to 1e-12 of the plain math; else kept as written,
    the reason naming what differs."""
    g = torch.Generator().manual_seed(9)
    x = 3 * torch.randn(T, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (T,), generator=g)
    target[0], target[1], target[-1] = 0, 15, V - 1
    weights = torch.randn(2, T, generator=g, dtype=torch.float64)

    def fn(logits):
        return _loss(*_OnlineLogSumExp.apply(logits * 2, target, 0.7, block, flaw), weights)

    def plain(logits):
        logp = (logits * 2 / 0.7).log_softmax(-1)
        return _loss(logp.gather(-1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1), weights)

    ((exact,), (eager_x,), (x,)), (want, eager, value), record, reasons = _three_ways(fn, plain, x)
    if flaw == "none" or (flaw == "sum not rescaled" and block == V):  # one block: nothing to rescale
        assert [(s.replaced_function is not None, s.kind) for s in record.sites] == [(True, "logprob+entropy")] \
            and reasons == [], record
        assert mixed_error(value, want) <= 1e-12 and mixed_error(x.grad, exact.grad) <= 1e-12
        return
    assert record.sites == [] and len(reasons) == 1, (record.sites, record.rejected)
    assert mixed_error(value, eager) <= 1e-12 and mixed_error(x.grad, eager_x.grad) <= 1e-12
    expected = {"sum not rescaled": "is not a log-prob or an entropy",
                "entropy gradient dropped": "not the gradient of its forward's math"}[flaw]
    assert expected in reasons[0], reasons[0]


class _LogSumExp(torch.autograd.Function):
    """A row's log-sum-exp: normalises its logits, but is no log-prob or entropy."""

    @staticmethod
    def forward(ctx, logits):
        lse = logits.logsumexp(-1)
        ctx.save_for_backward(logits, lse)
        return lse

    @staticmethod
    def backward(ctx, grad):
        logits, lse = ctx.saved_tensors
        return (logits - lse[:, None]).exp() * grad[:, None]


def test_a_log_normaliser_that_is_no_log_prob_is_kept_with_its_reason():
    x = torch.randn(T, V, dtype=torch.float64, requires_grad=True)
    value, record = _compile(lambda logits: (_LogSumExp.apply(logits) * torch.arange(T)).sum(), x)
    value.backward()
    reasons = [r.reason for r in record.rejected if "autograd.Function kept" in r.reason]
    assert record.sites == [] and len(reasons) == 1 and "logsumexp" in reasons[0] and \
        "is not a log-prob or an entropy" in reasons[0], (record.sites, record.rejected)
    assert mixed_error(x.grad, torch.softmax(x.detach(), -1) * torch.arange(T)[:, None]) <= 1e-12


class _VocabParallelWithoutGroup(torch.autograd.Function):
    """slime's `_VocabParallelLogProbEntropy` run without a process group (restated from
    slime/utils/ppo_utils.py: its `_maybe_all_reduce` skips every all-reduce, its rank is 0): the
    target's logit read at `target - 0` and zeroed where the target lies outside [0, V)."""

    @staticmethod
    def forward(ctx, logits, target):
        first, width = 0, logits.shape[-1]
        foreign = (target < first) | (target >= first + width)
        local = (target - first).clone()
        local[foreign] = 0
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        picked = shifted[torch.arange(logits.shape[0]), local].masked_fill_(foreign, 0.0).unsqueeze(-1)
        sum_exp = shifted.exp().sum(dim=-1, keepdim=True)
        ctx.save_for_backward(shifted.exp() / sum_exp, foreign, local)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad):
        softmax, foreign, local = ctx.saved_tensors
        g = -softmax
        g[torch.arange(g.shape[0]), local] += (~foreign).to(g.dtype)
        return g * grad, None


def test_a_vocab_parallel_function_run_without_a_group_is_the_vocab_parallel_op_of_one_rank():
    """Read as one device's code its target's logit, zeroed outside [0, V), is no gather; read as
    a vocab-parallel forward of one rank it is the log-prob, and the op checks the targets."""
    x = torch.randn(T, V, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (T,))
    value, record = _compile(lambda logits, t: _VocabParallelWithoutGroup.apply(logits, t).sum(), x, target)
    value.backward()
    assert [(s.kind, s.tp_size, s.collectives) for s in record.sites] == [("logprob", 1, [])], record.rejected
    eager = x.detach().clone().requires_grad_()
    want = _VocabParallelWithoutGroup.apply(eager, target).sum()
    want.backward()
    assert mixed_error(value, want) <= 1e-12 and mixed_error(x.grad, eager.grad) <= 1e-12
    target[0] = -100  # outside the columns: eager's log-prob is meaningless there, the op says so
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _compile(lambda logits, t: _VocabParallelWithoutGroup.apply(logits, t).sum(), x, target)


# ---- Functions that multiply by the output layer themselves ---------------------------------------
class _HeadChunked(torch.autograd.Function):
    """TRL's / prime-rl's / NeMo-RL's shape: per chunk of rows, `z = hidden @ W.T / t`, its
    log-prob and entropy, each row's log-sum-exp saved; in backward `z` recomputed, `dz`, then
    `dhidden[chunk] = dz @ W / t` and `dW += dz.T @ hidden[chunk] / t`. `flaw` names how the
    backward differs from the gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature: float, chunk: int, flaw: str):
        logprobs, entropies, lses = [], [], []
        for start in range(0, hidden.shape[0], chunk):
            z = hidden[start:start + chunk] @ weight.T / temperature
            lse = z.logsumexp(-1)
            p = (z - lse[:, None]).exp()
            logprobs.append(z.gather(-1, target[start:start + chunk, None])[:, 0] - lse)
            entropies.append(lse - (p * z).sum(-1))
            lses.append(lse)
        ctx.save_for_backward(hidden, weight, target, torch.cat(lses))
        ctx.temperature, ctx.chunk, ctx.flaw = temperature, chunk, flaw
        return torch.cat(logprobs), torch.cat(entropies)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, target, lse = ctx.saved_tensors
        t, flaw = ctx.temperature, ctx.flaw
        dhidden, dweight = torch.empty_like(hidden), torch.zeros_like(weight)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = hidden[rows] @ weight.T / t
            p = (z - lse[rows, None]).exp()
            dz = (-p * grad_logprob[rows, None]).scatter_add(-1, target[rows, None], grad_logprob[rows, None])
            if flaw != "entropy gradient dropped":
                dz = dz + p * ((p * z).sum(-1, keepdim=True) - z) * grad_entropy[rows, None]
            dhidden[rows] = dz @ weight / t
            dweight += dz.T @ hidden[rows] / (1.0 if flaw == "temperature forgotten in dW" else t)
        return dhidden, dweight, None, None, None, None


@pytest.mark.parametrize("flaw", ["none", "entropy gradient dropped", "temperature forgotten in dW"])
@pytest.mark.parametrize("chunk", [5, T])
def test_a_function_with_the_output_layer_inside_is_read_at_its_logits(flaw, chunk):
    """The Function becomes `hidden @ W.T` (the lm_head fused) and the plain math of its logits
    when its backward is their chain rule and its logits' gradient checks out; else it runs as
    written, the reason naming what differs. float64: values and both gradients to 1e-12."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 2
    target = torch.randint(0, V, (T,), generator=g)
    weights = torch.randn(2, T, generator=g, dtype=torch.float64)

    def fn(hidden, weight):
        return _loss(*_HeadChunked.apply(hidden, weight, target, 0.7, chunk, flaw), weights)

    def plain(hidden, weight):
        logp = (hidden @ weight.T / 0.7).log_softmax(-1)
        return _loss(logp.gather(-1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1), weights)

    (exact, eager, compiled), (want, got_eager, value), record, reasons = _three_ways(fn, plain, hidden, weight)
    if flaw == "none":
        assert [(s.replaced_function is not None, s.lm_head) for s in record.sites] == [(True, True)] and \
            reasons == [], (record.sites, record.rejected)
        assert mixed_error(value, want) <= 1e-12
        for got, exact_t in zip(compiled, exact):
            assert mixed_error(got.grad, exact_t.grad) <= 1e-12
        return
    assert record.sites == [] and len(reasons) == 1, (record.sites, record.rejected)
    assert mixed_error(value, got_eager) <= 1e-12
    for got, ref in zip(compiled, eager):
        assert mixed_error(got.grad, ref.grad) <= 1e-12
    expected = {"entropy gradient dropped": "is not the gradient of its forward's math",
                "temperature forgotten in dW": "multiplies different values"}[flaw]
    assert "output layer's product" in reasons[0] and expected in reasons[0], reasons[0]


class _HeadWithBias(torch.autograd.Function):
    """`hidden @ W.T + b` (or `F.linear`), its log-prob; `flaw` names how the backward differs,
    or which gradient it leaves out (None: autograd's gradient for that input is zero)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, spelling: str, flaw: str):
        z = F.linear(hidden, weight, bias) if spelling == "linear" else hidden @ weight.T + bias
        logp = z.log_softmax(-1)
        ctx.save_for_backward(logp, hidden, weight, target)
        ctx.flaw = flaw
        return logp.gather(-1, target[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad):
        logp, hidden, weight, target = ctx.saved_tensors
        dz = (F.one_hot(target, logp.shape[-1]).to(logp.dtype) - logp.exp()) * grad[:, None]
        grads = {"hidden": dz @ weight, "weight": dz.T @ hidden,
                 "bias": dz.sum(0) / (2.0 if ctx.flaw == "bias gradient halved" else 1.0)}
        return *(None if ctx.flaw == f"no {k} gradient" else g for k, g in grads.items()), None, None, None


def _with_bias_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64),
             torch.randn(V, generator=g, dtype=torch.float64)], torch.randint(0, V, (T,), generator=g),
            torch.randn(T, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("spelling", ["add", "linear"])
@pytest.mark.parametrize("flaw", ["none", "no hidden gradient", "no weight gradient", "no bias gradient"])
def test_an_output_layer_with_a_bias_is_read_at_its_logits(spelling, flaw):
    """The bias's gradient must be the logits' gradient summed over the rows; an input the
    backward returns no gradient for gets none from the rewrite either (it reads it detached).
    float64: values and every gradient to 1e-12, a missing one missing in both."""
    tensors, target, advantages = _with_bias_inputs(6)

    def fn(hidden, weight, bias):
        return (_HeadWithBias.apply(hidden, weight, bias, target, spelling, flaw) * advantages).sum()

    eager, compiled = ([t.clone().requires_grad_() for t in tensors] for _ in range(2))
    fn(*eager).backward()
    value, record = _compile(fn, *compiled)
    value.backward()
    assert [(s.replaced_function is not None, s.lm_head) for s in record.sites] == [(True, True)], record
    assert mixed_error(value, fn(*tensors)) <= 1e-12
    for got, ref in zip(compiled, eager):
        assert (got.grad is None) == (ref.grad is None) and (ref.grad is None or mixed_error(got.grad, ref.grad) <= 1e-12)


def test_a_bias_gradient_that_is_not_the_row_sum_keeps_the_function():
    tensors, target, advantages = _with_bias_inputs(7)

    def fn(hidden, weight, bias):
        return (_HeadWithBias.apply(hidden, weight, bias, target, "add", "bias gradient halved") * advantages).sum()

    (_, eager, compiled), _, record, reasons = _three_ways(fn, None, *tensors)
    assert record.sites == [] and len(reasons) == 1 and "the bias's gradients" in reasons[0] and \
        "substitute_in_graph" in reasons[0], record
    for got, ref in zip(compiled, eager):  # the Function ran as written, its halved bias gradient too
        assert mixed_error(got.grad, ref.grad) <= 1e-12


class _HeadInVocabularyBlocks(torch.autograd.Function):
    """TRL's and prime-rl's kernel shape, written in torch: the output layer multiplied a block of
    the weight's rows at a time (`hidden @ W[a:b].T`, `row_chunk` rows at a time where given),
    folded into an online log-sum-exp; in backward each block's logits recomputed, `dhidden +=
    dz @ W[a:b]` and `dW[a:b] += dz.T @ hidden` (`=` with `backward="blocks, assigned"`; the whole
    `dz @ W` at once with "whole"), accumulated in fp32. `flaw` names how the backward differs from the gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, target, block: int, row_chunk: int, backward: str, flaw: str):
        logprobs, entropies, lses = [], [], []
        for r in range(0, hidden.shape[0], row_chunk):
            h, y = hidden[r:r + row_chunk], target[r:r + row_chunk]
            m = torch.full(h.shape[:1], float("-inf"), dtype=torch.float32 if h.dtype == torch.bfloat16 else h.dtype)
            s, sx, picked = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
            for start in range(0, weight.shape[0], block):
                x = (h @ weight[start:start + block].T).to(m.dtype) / 0.7
                new_m = torch.maximum(m, x.amax(-1))
                rescale = (m - new_m).exp()
                e = (x - new_m[:, None]).exp()
                s.mul_(rescale).add_(e.sum(-1))
                sx.mul_(rescale).add_((e * x).sum(-1))
                m.copy_(new_m)
                inside = (y >= start) & (y < start + block)
                picked.copy_(torch.where(inside, x.gather(-1, (y - start).clamp(0, block - 1)[:, None])[:, 0], picked))
            lse = m + s.log()
            logprobs.append(picked - lse)
            entropies.append(lse - sx / s)
            lses.append(lse)
        logprob, entropy = torch.cat(logprobs), torch.cat(entropies)
        ctx.save_for_backward(hidden, weight, target, torch.cat(lses), entropy)
        ctx.block, ctx.backward, ctx.flaw = block, backward, flaw
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, target, lse, entropy = ctx.saved_tensors
        acc = torch.float32 if hidden.dtype == torch.bfloat16 else hidden.dtype
        dhidden, dweight = torch.zeros(hidden.shape, dtype=acc), torch.zeros(weight.shape, dtype=acc)
        blocks = [(0, weight.shape[0])] if ctx.backward == "whole" else \
            [(a, min(a + ctx.block, weight.shape[0])) for a in range(0, weight.shape[0], ctx.block)]
        for a, b in blocks:
            w = weight[a:b]
            x = (hidden @ w.T).to(acc) / 0.7
            logp = x - lse[:, None]
            p = logp.exp()
            dz = ((torch.arange(a, b) == target[:, None]).to(acc) - p) * grad_logprob[:, None]
            if ctx.flaw != "entropy gradient dropped":
                dz = dz - p * (logp + entropy[:, None]) * grad_entropy[:, None]
            dz = (dz / 0.7).to(hidden.dtype)
            dhidden += (dz @ w).to(acc)
            if ctx.flaw == "last block's weight gradient dropped" and b == weight.shape[0]:
                continue
            if ctx.backward == "blocks, assigned":
                dweight[a:b] = dz.T @ hidden
            else:
                dweight[a:b] += (dz.T @ hidden).to(acc)
        return dhidden.to(hidden.dtype), dweight.to(weight.dtype), None, None, None, None, None


def _head_inputs(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 3
    target = torch.randint(0, V, (T,), generator=g)
    target[0], target[1], target[-1] = 0, 15, V - 1
    return [hidden.to(dtype), weight.to(dtype)], target, torch.randn(2, T, generator=g, dtype=torch.float64)


def _head_plain(hidden, weight, target, weights):
    logp = (hidden @ weight.T / 0.7).log_softmax(-1)
    return _loss(logp.gather(-1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1), weights)


@pytest.mark.parametrize("block, flaw, backward", covering_grid(
    [8, 16, V], ["none", "entropy gradient dropped", "last block's weight gradient dropped"],
    ["blocks", "blocks, assigned", "whole"]))
def test_an_output_layer_in_vocabulary_blocks_is_read_as_one_product(block, flaw, backward):
    """The blocks' products are read as blocks of one `hidden @ W.T`, and the backward's sums over
    blocks as the whole products: the Function becomes the product and the plain math of its
    logits, the lm_head fused, float64 values and both gradients to 1e-12; a flawed backward runs
    as written, with the reason."""
    tensors, target, weights = _head_inputs(8)

    def fn(hidden, weight):
        return _loss(*_HeadInVocabularyBlocks.apply(hidden, weight, target, block, T, backward, flaw), weights)

    (exact, eager, compiled), (want, got_eager, value), record, reasons = _three_ways(
        fn, lambda hidden, weight: _head_plain(hidden, weight, target, weights), *tensors)
    # The whole-weight backward's dW[0:V] = ... is one product: a dropped last block drops all of it.
    if flaw == "none":
        assert [(s.replaced_function is not None, s.lm_head, s.kind) for s in record.sites] == \
            [(True, True, "logprob+entropy")] and reasons == [], record
        assert mixed_error(value, want) <= 1e-12
        for got, exact_t in zip(compiled, exact):
            assert mixed_error(got.grad, exact_t.grad) <= 1e-12
        return
    assert not any(s.replaced_function for s in record.sites) and len(reasons) == 1, record
    assert mixed_error(value, got_eager) <= 1e-12
    for got, ref in zip(compiled, eager):
        assert mixed_error(got.grad, ref.grad) <= 1e-12
    expected = "not the gradient of its forward's math" if flaw == "entropy gradient dropped" else \
        "the weight's gradient"
    assert expected in reasons[0], reasons[0]


def test_an_output_layer_in_vocabulary_blocks_in_bf16_is_as_close_to_float64_as_the_function():
    """In bf16 the rewrite keeps fp32 statistics and accumulation: no farther from float64 than
    the Function's own arithmetic (plus bf16's rounding of the result)."""
    tensors, target, weights = _head_inputs(9, torch.bfloat16)

    def fn(hidden, weight):
        return _loss(*_HeadInVocabularyBlocks.apply(hidden, weight, target, 16, T, "blocks", "none"), weights)

    exact, eager, compiled = ([t.detach().to(dt).requires_grad_() for t in tensors]
                              for dt in (torch.float64, torch.bfloat16, torch.bfloat16))
    _head_plain(*exact, target, weights).backward()
    fn(*eager).backward()
    value, record = _compile(fn, *compiled)
    value.backward()
    assert [(s.replaced_function is not None, s.lm_head) for s in record.sites] == [(True, True)], record
    for got, ref, exact_t in zip(compiled, eager, exact):
        assert mixed_error(got.grad, exact_t.grad) <= 2 * mixed_error(ref.grad, exact_t.grad) + 1e-2


class _UpcastBlocks(torch.autograd.Function):
    """bf16 hidden states and weight upcast before each block's product (an fp32 GEMM): one bf16
    product in their place would round where the Function does not."""

    @staticmethod
    def forward(ctx, hidden, weight, target):
        blocks = [hidden.float() @ weight[a:a + 16].float().T for a in range(0, weight.shape[0], 16)]
        logp = torch.cat(blocks, -1).log_softmax(-1)
        ctx.save_for_backward(hidden, weight, target, logp)
        return logp.gather(-1, target[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, logp = ctx.saved_tensors
        dz = (F.one_hot(target, weight.shape[0]).float() - logp.exp()) * grad[:, None]
        return (dz @ weight.float()).to(hidden.dtype), (dz.T @ hidden.float()).to(weight.dtype), None


def test_vocabulary_blocks_of_an_upcast_weight_keep_the_function_with_the_reason():
    tensors, target, weights = _head_inputs(11, torch.bfloat16)

    def fn(hidden, weight):
        return (_UpcastBlocks.apply(hidden, weight, target) * weights[0]).sum()

    (_, eager, compiled), _, record, reasons = _three_ways(fn, None, *tensors)
    assert not any(s.replaced_function for s in record.sites) and len(reasons) == 1 and \
        "casts the hidden states or the weight" in reasons[0], record
    for got, ref in zip(compiled, eager):
        assert torch.equal(got.grad, ref.grad)


def test_vocabulary_blocks_inside_chunks_of_rows_keep_the_function_with_the_reason():
    tensors, target, weights = _head_inputs(10)

    def fn(hidden, weight):
        return _loss(*_HeadInVocabularyBlocks.apply(hidden, weight, target, 16, 5, "blocks", "none"), weights)

    (_, eager, compiled), _, record, reasons = _three_ways(fn, None, *tensors)
    assert not any(s.replaced_function for s in record.sites) and len(reasons) == 1 and \
        "chunks of the hidden states' rows" in reasons[0] and "substitute_in_graph" in reasons[0], record
    for got, ref in zip(compiled, eager):
        assert mixed_error(got.grad, ref.grad) <= 1e-12


class _HeadTransposed(torch.autograd.Function):
    """An `[H, V]` weight (`hidden @ W`), the product upcast to fp32, `dz` cast back for the GEMMs."""

    @staticmethod
    def forward(ctx, hidden, weight, target):
        logp = (hidden @ weight).float().log_softmax(-1)
        ctx.save_for_backward(hidden, weight, target, logp)
        return logp.gather(-1, target[:, None])[:, 0].to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, logp = ctx.saved_tensors
        dz = ((F.one_hot(target, logp.shape[-1]).float() - logp.exp()) * grad.float()[:, None]).to(hidden.dtype)
        return dz @ weight.T, hidden.T @ dz, None


def test_an_output_layer_stored_transposed_is_read_too():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(H, V, generator=g, dtype=torch.float64) / 3
    target = torch.randint(0, V, (T,), generator=g)
    advantages = torch.randn(T, generator=g, dtype=torch.float64)

    def fn(hidden, weight):
        return (_HeadTransposed.apply(hidden, weight, target) * advantages).sum()

    def plain(hidden, weight):
        return ((hidden @ weight).log_softmax(-1).gather(-1, target[:, None])[:, 0] * advantages).sum()

    exact, eager, compiled = ([t.clone().requires_grad_() for t in (hidden, weight)] for _ in range(3))
    want, got_eager = plain(*exact), fn(*eager)
    want.backward()
    got_eager.backward()
    value, record = _compile(fn, *compiled)
    value.backward()
    assert [(s.replaced_function is not None, s.lm_head) for s in record.sites] == [(True, True)], record
    # As close to the float64 math as eager's Function (whose upcast rounds to float32).
    assert mixed_error(value, want) <= 2 * mixed_error(got_eager, want) + 1e-12
    for got, ref, exact_t in zip(compiled, eager, exact):
        assert mixed_error(got.grad, exact_t.grad) <= 2 * mixed_error(ref.grad, exact_t.grad) + 1e-12


# ---- symbolic sizes: a second length compiled (automatic dynamic), or dynamic=True --------------
class _VocabSizeAsANumber(torch.autograd.Function):
    """Log-probs whose backward scales by the vocabulary's size over 40: the gradient where the
    vocabulary has 40 columns, not where it has any other number."""

    @staticmethod
    def forward(ctx, logits, target):
        logp = logits.log_softmax(-1)
        ctx.save_for_backward(logp, target)
        return logp.gather(-1, target[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad):
        logp, target = ctx.saved_tensors
        dlogits = (-logp.exp() * grad[:, None]).scatter_add(-1, target[:, None], grad[:, None])
        return dlogits * (logp.shape[-1] // V), None


def _apply(function, logits, target):
    """(log-probs, entropies or an empty tensor) of `function` on `logits`."""
    if function == "slime":
        return _SlimeStyle.apply(logits, target, 0.7, True)
    if function == "megatron":
        return -_MegatronStyle.apply(logits, target), logits.new_zeros((0,))
    if function == "twin, straight-through":
        return _Twin.apply(logits, target, None, "straight-through")
    one_device = {"one_hot": _OneHotStyle, "vocabulary size as a number": _VocabSizeAsANumber}[function]
    return one_device.apply(logits, target), logits.new_zeros((0,))


def _plain(function, logits, target, weights):
    """`fn`'s loss in test_a_function_called_with_symbolic_sizes as plain math in float64, or as
    the Function computes it where its backward is not the gradient (eager's is the reference)."""
    if function not in ("slime", "megatron", "one_hot"):
        logprob, entropy = _apply(function, logits, target)
    else:
        logp = (logits / (0.7 if function == "slime" else 1.0)).log_softmax(-1)
        logprob = logp.gather(-1, target[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1) if function == "slime" else logits.new_zeros((0,))
    return _loss(logprob, entropy, weights) + logits.logsumexp(-1).mean()


@pytest.mark.parametrize("dynamic", ["a second length", "dynamic=True"])
@pytest.mark.parametrize("function", ["slime", "megatron", "one_hot", "twin, straight-through",
                                      "vocabulary size as a number"])
def test_a_function_called_with_symbolic_sizes(function, dynamic):
    """Dynamo makes sizes symbolic from the second length it compiles (or at once with
    dynamic=True) and passes them to the Function: a Function whose backward is the gradient is
    still replaced (its backward checked at the example sizes, and where the vocabulary is
    symbolic at twice its width too); the others stay as written, reason recorded, and the graph
    around them is rewritten. Values and gradients are eager's."""
    backend = graphpass.Backend(inner="aot_eager")

    def fn(logits, target, weights):
        logprob, entropy = _apply(function, logits, target)
        return _loss(logprob, entropy, weights) + logits.logsumexp(-1).mean()  # a site beside it

    compiled_fn = torch.compile(fn, backend=backend, dynamic=True if dynamic == "dynamic=True" else None)
    g = torch.Generator().manual_seed(3)
    for rows in ([T, T + 8] if dynamic == "a second length" else [T]):
        x = 3 * torch.randn(rows, V, generator=g, dtype=torch.float64)
        target = torch.randint(0, V, (rows,), generator=g)
        weights = torch.randn(2, rows, generator=g, dtype=torch.float64)
        eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        exact_x = x.clone().requires_grad_()
        eager, value, want = fn(eager_x, target, weights), compiled_fn(compiled_x, target, weights), \
            _plain(function, exact_x, target, weights)
        for loss in (eager, value, want):
            loss.backward()
        # As close to the math (float64) as eager (slime's upcast rounds to float32).
        assert mixed_error(value, want) <= 2 * mixed_error(eager, want) + 1e-12
        assert mixed_error(compiled_x.grad, exact_x.grad) <= 2 * mixed_error(eager_x.grad, exact_x.grad) + 1e-12
    record = backend.records[-1]
    assert record.fallback_reason is None, record.fallback_reason
    shape = record.sites[0].shape if record.sites else None
    assert any(not isinstance(s, int) for s in shape), shape  # the graph compiled for symbolic sizes
    reasons = [r.reason for r in record.rejected if "autograd.Function kept" in r.reason]
    replaced = [s.replaced_function is not None for s in record.sites]
    kept = function == "twin, straight-through" or (function == "vocabulary size as a number"
                                                    and dynamic == "dynamic=True")
    if not kept:
        assert True in replaced and reasons == [], (record.sites, record.rejected)
        return
    assert True not in replaced and len(record.sites) == 1 and len(reasons) == 1, (record.sites, record.rejected)
    assert "its backward is not the gradient of its forward's math" in reasons[0], reasons[0]
