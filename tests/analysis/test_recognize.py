"""Unit tests of `graphpass.analysis.recognize.label_output` on tiny pre-dispatch ATen graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphpass.capture import capture as capture_graph
from graphpass.analysis.recognize import OutputLabel, label_output

T, V = 5, 7
B, S = 2, 3


def _capturing_backend(captured: list):
    """A backend that appends the pre-dispatch ATen graph the core would see, then runs eagerly."""

    def backend(gm, example_inputs):
        captured.append(capture_graph(gm, example_inputs).gm)
        return gm.forward

    return backend


def capture(fn, *args) -> torch.fx.GraphModule:
    """The last pre-dispatch ATen graph Dynamo hands a backend for `fn(*args)` (as the core sees it)."""
    captured = []

    backend = _capturing_backend(captured)

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return captured[-1]


def output_labels(fn, *args) -> list[OutputLabel]:
    gm = capture(fn, *args)
    (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [label_output(o) for o in outs]


def inputs(layout="2d"):
    if layout == "2d":
        return torch.randn(T, V, requires_grad=True), torch.randint(0, V, (T,))
    return torch.randn(B, S, V, requires_grad=True), torch.randint(0, V, (B, S))


def _scaled(x, temp):
    """The logits scaled the way a test case asks: None, a float divisor, or ("*", c)."""
    if temp is None:
        return x
    if isinstance(temp, tuple):
        return x * temp[1]
    return x / temp


# ---- log-prob spellings ------------------------------------------------------------------------


def lp_log_softmax_gather(x, t, temp=None):
    return F.log_softmax(_scaled(x, temp), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def lp_log_softmax_gather_keepdim(x, t, temp=None):
    return F.log_softmax(_scaled(x, temp), dim=-1).gather(-1, t[:, None])  # [T, 1]


def lp_take_along_dim(x, t, temp=None):
    return torch.take_along_dim(F.log_softmax(_scaled(x, temp), -1), t[:, None], dim=-1).squeeze(-1)


def lp_x_minus_logsumexp(x, t, temp=None):
    y = _scaled(x, temp)
    lp = y - torch.logsumexp(y, -1, keepdim=True)
    return lp.gather(-1, t[:, None]).squeeze(-1)


def lp_log_of_softmax(x, t, temp=None):
    return torch.log(F.softmax(_scaled(x, temp), -1)).gather(-1, t[:, None]).squeeze(-1)


def lp_gather_minus_logsumexp(x, t, temp=None):
    y = _scaled(x, temp)
    return y.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(y, -1)


def lp_neg_cross_entropy(x, t, temp=None):
    return -F.cross_entropy(_scaled(x, temp), t, reduction="none")


def lp_neg_nll_loss(x, t, temp=None):
    return -F.nll_loss(F.log_softmax(_scaled(x, temp), -1), t, reduction="none")


def lp_neg_cross_entropy_view_as(x, t, temp=None):
    return -F.cross_entropy(_scaled(x, temp), t, reduction="none").view_as(t)


def lp_neg_nll_loss_reshape_as(x, t, temp=None):
    return -F.nll_loss(F.log_softmax(_scaled(x, temp), -1), t, reduction="none").reshape_as(t)


def lp_float_upcast(x, t, temp=None):
    return F.log_softmax(_scaled(x.float(), temp), -1).gather(-1, t[:, None]).squeeze(-1)


def lp_double_negation(x, t, temp=None):
    nlp = -F.log_softmax(_scaled(x, temp), -1)
    return -(nlp.gather(-1, t[:, None]).squeeze(-1))


def lp_masked_fill_top_p(x, t, temp=None):
    y = _scaled(x, temp)
    y = y.masked_fill(y < y.mean(-1, keepdim=True) - 1.0, float("-inf"))
    return F.log_softmax(y, -1).gather(-1, t[:, None]).squeeze(-1)


def lp_where_top_p(x, t, temp=None):
    y = _scaled(x, temp)
    y = torch.where(y < -1.5, float("-inf"), y)
    return F.log_softmax(y, -1).gather(-1, t[:, None]).squeeze(-1)


def lp_view_and_float(x, t, temp=None):
    lp = F.log_softmax(_scaled(x, temp), -1).gather(-1, t.view(-1, 1))
    return lp.view(-1).float()


LOGPROB_FORMS = [
    lp_log_softmax_gather,
    lp_log_softmax_gather_keepdim,
    lp_take_along_dim,
    lp_x_minus_logsumexp,
    lp_log_of_softmax,
    lp_gather_minus_logsumexp,
    lp_neg_cross_entropy,
    lp_neg_nll_loss,
    lp_neg_cross_entropy_view_as,
    lp_neg_nll_loss_reshape_as,
    lp_float_upcast,
    lp_double_negation,
    lp_masked_fill_top_p,
    lp_where_top_p,
    lp_view_and_float,
]

# ---- entropy spellings -------------------------------------------------------------------------


def ent_neg_sum_p_logp(x, t, temp=None):
    y = _scaled(x, temp)
    p, lp = F.softmax(y, -1), F.log_softmax(y, -1)
    return -(p * lp).sum(-1)


def ent_exp_logp(x, t, temp=None):
    lp = F.log_softmax(_scaled(x, temp), -1)
    return -(lp.exp() * lp).sum(-1)


def ent_logsumexp_minus_expected_logit(x, t, temp=None):
    y = _scaled(x, temp)
    return torch.logsumexp(y, -1) - (F.softmax(y, -1) * y).sum(-1)


def ent_categorical(x, t, temp=None):
    return torch.distributions.Categorical(logits=_scaled(x, temp)).entropy()


def ent_special_entr(x, t, temp=None):
    return torch.special.entr(F.softmax(_scaled(x, temp), -1)).sum(-1)


def ent_p_log_p_of_softmax(x, t, temp=None):
    p = F.softmax(_scaled(x, temp), -1)
    return -(p * torch.log(p)).sum(-1)


def ent_neg_inside_product(x, t, temp=None):
    y = _scaled(x, temp)
    return (F.softmax(y, -1) * -F.log_softmax(y, -1)).sum(-1)


def ent_neg_p_first(x, t, temp=None):
    y = _scaled(x, temp)
    return (-F.softmax(y, -1) * F.log_softmax(y, -1)).sum(dim=-1)


def ent_sum_then_scale_minus_one(x, t, temp=None):
    y = _scaled(x, temp)
    return (F.softmax(y, -1) * F.log_softmax(y, -1)).sum(-1) * -1.0


def ent_float_upcast(x, t, temp=None):
    lp = F.log_softmax(_scaled(x.float(), temp), -1)
    return -(lp.exp() * lp).sum(-1)


ENTROPY_FORMS = [
    ent_neg_sum_p_logp,
    ent_exp_logp,
    ent_logsumexp_minus_expected_logit,
    ent_categorical,
    ent_special_entr,
    ent_p_log_p_of_softmax,
    ent_neg_inside_product,
    ent_neg_p_first,
    ent_sum_then_scale_minus_one,
    ent_float_upcast,
]

# ---- must not be labelled log-prob or entropy --------------------------------------------------


def rw_sampled_token_plogp(x, t, temp=None):
    lp = F.log_softmax(_scaled(x, temp), -1).gather(-1, t[:, None]).squeeze(-1)
    return -lp.exp() * lp  # -p(y) log p(y): one token, not the entropy


def rw_sampled_token_softmax_times_logsoftmax(x, t, temp=None):
    y = _scaled(x, temp)
    p = F.softmax(y, -1).gather(-1, t[:, None])
    lp = F.log_softmax(y, -1).gather(-1, t[:, None])
    return -(p * lp).squeeze(-1)


def rw_max_log_prob(x, t, temp=None):
    return F.log_softmax(_scaled(x, temp), -1).max(-1).values


def rw_probability_of_token(x, t, temp=None):
    return F.softmax(_scaled(x, temp), -1).gather(-1, t[:, None]).squeeze(-1)


def rw_sum_of_logits(x, t, temp=None):
    return _scaled(x, temp).sum(-1)


def rw_sum_of_log_probs(x, t, temp=None):
    return F.log_softmax(_scaled(x, temp), -1).sum(-1)


def rw_logsumexp_only(x, t, temp=None):
    return torch.logsumexp(_scaled(x, temp), -1)


def rw_mismatched_logits(x, t, temp=None):
    # gather from the unscaled logits, normaliser from the scaled ones: not a log-prob of either.
    return x.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(x / 0.7, -1)


def rw_twice_logprob(x, t, temp=None):
    return 2.0 * F.log_softmax(_scaled(x, temp), -1).gather(-1, t[:, None]).squeeze(-1)


def rw_label_smoothing(x, t, temp=None):
    return -F.cross_entropy(_scaled(x, temp), t, reduction="none", label_smoothing=0.1)


def rw_entropy_of_other_logits(x, t, temp=None):
    # softmax of one tensor weighted by the log-softmax of another: a cross-entropy, not an entropy.
    return -(F.softmax(x, -1) * F.log_softmax(x * 2.0, -1)).sum(-1)


def rw_entropy_times_mask(x, t, temp=None):
    lp = F.log_softmax(_scaled(x, temp), -1)
    return -(lp.exp() * lp).sum(-1) * (t > 2).float()


ROWWISE_FORMS = [
    rw_sampled_token_plogp,
    rw_sampled_token_softmax_times_logsoftmax,
    rw_max_log_prob,
    rw_probability_of_token,
    rw_sum_of_logits,
    rw_sum_of_log_probs,
    rw_logsumexp_only,
    rw_mismatched_logits,
    rw_twice_logprob,
    rw_label_smoothing,
    rw_entropy_of_other_logits,
    rw_entropy_times_mask,
]

TEMPERATURES = [(None, None), (0.7, "/ 0.7"), (("*", 1 / 0.7), "* 1.43")]


def _ids(fns):
    return [f.__name__ for f in fns]


@pytest.mark.parametrize("temp,temp_text", TEMPERATURES, ids=["plain", "div", "mul"])
@pytest.mark.parametrize("fn", LOGPROB_FORMS, ids=_ids(LOGPROB_FORMS))
def test_logprob_forms(fn, temp, temp_text):
    x, t = inputs()
    assert output_labels(lambda x, t: fn(x, t, temp), x, t) == [OutputLabel("logprob", temp_text)]


@pytest.mark.parametrize("temp,temp_text", TEMPERATURES, ids=["plain", "div", "mul"])
@pytest.mark.parametrize("fn", ENTROPY_FORMS, ids=_ids(ENTROPY_FORMS))
def test_entropy_forms(fn, temp, temp_text):
    x, t = inputs()
    assert output_labels(lambda x, t: fn(x, t, temp), x, t) == [OutputLabel("entropy", temp_text)]


@pytest.mark.parametrize("temp", [None, 0.7], ids=["plain", "div"])
@pytest.mark.parametrize("fn", ROWWISE_FORMS, ids=_ids(ROWWISE_FORMS))
def test_rowwise_forms(fn, temp):
    x, t = inputs()
    assert output_labels(lambda x, t: fn(x, t, temp), x, t) == [OutputLabel("rowwise", None)]


# ---- negations and hand-written softmaxes ---------------------------------------------------------


def neg_cross_entropy(x, t, temp=None):
    return F.cross_entropy(_scaled(x, temp), t, reduction="none")  # a loss, the negated log-prob


def neg_sum_p_logp(x, t, temp=None):
    y = _scaled(x, temp)
    return (F.softmax(y, -1) * F.log_softmax(y, -1)).sum(-1)  # the negative entropy


def neg_manual_cross_entropy(x, t, temp=None):
    # Megatron's spelling: subtract the row max, pick the target, log of the sum of exps.
    y = _scaled(x, temp)
    shifted = y - y.max(-1)[0].unsqueeze(-1)
    picked = shifted.gather(-1, t[:, None]).squeeze(-1)
    return torch.log(shifted.exp().sum(-1)) - picked


def lp_manual_softmax_in_place(x, t, temp=None):
    y = _scaled(x, temp).clone()
    y.sub_(y.amax(-1, keepdim=True).detach())
    y.exp_()
    y.div_(y.sum(-1, keepdim=True))
    return torch.log(y.gather(-1, t[:, None]).squeeze(-1))


def ent_p_log_p_eps(x, t, temp=None):
    p = F.softmax(_scaled(x, temp), -1)
    return -(p * torch.log(p + 1e-10)).sum(-1)


@pytest.mark.parametrize("temp,temp_text", TEMPERATURES, ids=["plain", "div", "mul"])
@pytest.mark.parametrize("fn,kind", [(neg_cross_entropy, "-logprob"), (neg_sum_p_logp, "-entropy"),
                                     (neg_manual_cross_entropy, "-logprob"),
                                     (lp_manual_softmax_in_place, "logprob"), (ent_p_log_p_eps, "entropy")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_negated_and_hand_written_forms(fn, kind, temp, temp_text):
    x, t = inputs()
    assert output_labels(lambda x, t: fn(x, t, temp), x, t) == [OutputLabel(kind, temp_text)]


def test_probability_of_token_is_not_a_log_prob():
    x, t = inputs()
    fn = lambda x, t: torch.log(F.softmax(x, -1).gather(-1, t[:, None]).squeeze(-1) + 0.5)  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("rowwise")]


# ---- layouts [B, S, V] ---------------------------------------------------------------------------


def test_3d_log_softmax_dim2_gather_dim2():
    x, t = inputs("3d")
    fn = lambda x, t: F.log_softmax(x, 2).gather(2, t.unsqueeze(2)).squeeze(2)  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("logprob")]


def test_2d_log_softmax_dim1_gather_dim1():
    x, t = inputs()
    fn = lambda x, t: F.log_softmax(x, 1).gather(1, t.unsqueeze(1)).squeeze(1)  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("logprob")]


def test_3d_log_softmax_over_sequence_is_not_logprob():
    x, t = inputs("3d")
    # Normalising over dim 1 (the sequence) and gathering along V: not a log-prob over V.
    fn = lambda x, t: F.log_softmax(x, 1).gather(2, t.unsqueeze(2)).squeeze(2)  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("rowwise")]


def test_3d_cross_entropy_transposed():
    x, t = inputs("3d")
    fn = lambda x, t: -F.cross_entropy(x.transpose(1, 2) / 0.7, t, reduction="none")  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("logprob", "/ 0.7")]


def test_3d_nll_loss_transposed():
    x, t = inputs("3d")
    fn = lambda x, t: -F.nll_loss(F.log_softmax(x, -1).transpose(1, 2), t, reduction="none")  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("logprob")]


def test_3d_cross_entropy_over_wrong_dim_is_rowwise():
    x, t = inputs("3d")
    # A [B, S, V] tensor passed straight to cross_entropy treats S as the class dim.
    t2 = torch.randint(0, S, (B, V))
    fn = lambda x, t: -F.cross_entropy(x, t, reduction="none")  # noqa: E731
    assert output_labels(fn, x, t2) == [OutputLabel("rowwise")]


def test_3d_cross_entropy_flattened():
    x, t = inputs("3d")
    fn = lambda x, t: -F.cross_entropy(x.view(-1, V), t.view(-1), reduction="none").view(B, S)  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("logprob")]


def test_categorical_log_prob_and_entropy():
    x, t = inputs()

    def fn(x, t):
        dist = torch.distributions.Categorical(logits=x / 0.7)
        return dist.log_prob(t), dist.entropy()  # log_prob broadcasts the index against the logits

    assert output_labels(fn, x, t) == [OutputLabel("logprob", "/ 0.7"), OutputLabel("entropy", "/ 0.7")]


def test_3d_categorical_entropy():
    x, t = inputs("3d")
    fn = lambda x, t: torch.distributions.Categorical(logits=x / 0.7).entropy()  # noqa: E731
    assert output_labels(fn, x, t) == [OutputLabel("entropy", "/ 0.7")]


def test_3d_flatten_then_logprob_and_entropy():
    x, t = inputs("3d")

    def fn(x, t):
        lp = F.log_softmax(x.reshape(-1, V).float(), -1)
        return lp.gather(-1, t.reshape(-1, 1)).view(B, S), -(lp.exp() * lp).sum(-1).view(B, S)

    assert output_labels(fn, x, t) == [OutputLabel("logprob"), OutputLabel("entropy")]


# ---- temperature spellings -----------------------------------------------------------------------


def test_inplace_div_on_clone():
    x, t = inputs()

    def fn(x, t):
        y = x.clone()
        y.div_(0.7)
        return F.log_softmax(y, -1).gather(-1, t[:, None]).squeeze(-1)

    assert output_labels(fn, x, t) == [OutputLabel("logprob", "/ 0.7")]


def test_per_token_temperature():
    x, t = inputs()
    temp = torch.rand(T) + 0.5

    def fn(x, t, temp):
        lp = F.log_softmax(x / temp[:, None], -1)
        return lp.gather(-1, t[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)

    labels = output_labels(fn, x, t, temp)
    assert labels == [OutputLabel("logprob", "/ per-token"), OutputLabel("entropy", "/ per-token")]


def _runtime_scalar_graph(fn):
    """Compile `fn(x, t, temp)` twice with different floats: the second graph reads temp via .item()."""
    x, t = inputs()
    captured = []

    backend = _capturing_backend(captured)

    compiled = torch.compile(fn, backend=backend)
    compiled(x, t, 0.7)
    compiled(x, t, 0.9)
    gm = captured[-1]
    assert any(n.target is torch.ops.aten.item.default for n in gm.graph.nodes), "no runtime scalar"
    (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [label_output(o) for o in outs], gm


def test_runtime_scalar_divisor():
    def fn(x, t, temp):
        lp = F.log_softmax(x / temp, -1)
        return lp.gather(-1, t[:, None]).squeeze(-1), torch.distributions.Categorical(logits=x / temp).entropy()

    labels, gm = _runtime_scalar_graph(fn)
    item = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.item.default)
    assert labels == [OutputLabel("logprob", f"/ {item.name}"), OutputLabel("entropy", f"/ {item.name}")]


def test_runtime_scalar_reciprocal_multiplier():
    def fn(x, t, temp):
        return F.log_softmax(x * (1 / temp), -1).gather(-1, t[:, None]).squeeze(-1)

    labels, gm = _runtime_scalar_graph(fn)
    item = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.item.default)
    assert labels == [OutputLabel("logprob", f"/ {item.name}")]


def test_temperature_after_mask_and_upcast():
    x, t = inputs()

    def fn(x, t):
        y = x.float().masked_fill(x < -1.0, float("-inf")) / 0.7
        return F.log_softmax(y, -1).gather(-1, t[:, None]).squeeze(-1)

    assert output_labels(fn, x, t) == [OutputLabel("logprob", "/ 0.7")]


# ---- graphs with several outputs -----------------------------------------------------------------


def test_shared_log_softmax_no_grad_entropy():
    x, t = inputs()

    def fn(x, t):
        lp = F.log_softmax(x / 0.7, -1)
        with torch.no_grad():
            ent = -(lp.exp() * lp).sum(-1)
        return lp.gather(-1, t[:, None]).squeeze(-1), ent

    assert output_labels(fn, x, t) == [OutputLabel("logprob", "/ 0.7"), OutputLabel("entropy", "/ 0.7")]


def test_unrolled_chunk_loop_cat():
    x, t = inputs()

    def fn(x, t):
        lps, ents = [], []
        for i in range(0, T, 2):
            lp = F.log_softmax(x[i : i + 2], -1)
            lps.append(lp.gather(-1, t[i : i + 2, None]).squeeze(-1))
            ents.append(-(lp.exp() * lp).sum(-1))
        return torch.cat(lps), torch.cat(ents), lps[0]

    assert output_labels(fn, x, t) == [OutputLabel("logprob"), OutputLabel("entropy"), OutputLabel("logprob")]


def test_cat_of_mixed_kinds_is_rowwise():
    x, t = inputs()

    def fn(x, t):
        lp = F.log_softmax(x, -1)
        return torch.cat([lp.gather(-1, t[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)])

    assert output_labels(fn, x, t) == [OutputLabel("rowwise")]


def test_label_is_hashable_and_frozen():
    label = OutputLabel("logprob", "/ 0.7")
    assert {label: 1}[OutputLabel("logprob", "/ 0.7")] == 1
    with pytest.raises(Exception):
        label.kind = "entropy"


def test_symbolic_shapes():
    """With dynamic=True the sizes are SymInts: labels must not need (or guard on) concrete sizes."""
    x, t = inputs()
    temp = torch.rand(T) + 0.5
    captured = []

    backend = _capturing_backend(captured)

    def fn(x, t, temp):
        lp = F.log_softmax(x / temp[:, None], -1)
        return (lp.gather(-1, t[:, None]).squeeze(-1), torch.distributions.Categorical(logits=x / 0.7).entropy(),
                -F.cross_entropy(x, t, reduction="none"))

    torch.compile(fn, backend=backend, dynamic=True)(x, t, temp)
    (outs,) = [n.args[0] for n in captured[-1].graph.nodes if n.op == "output"]
    tensors = [o for o in outs if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
    assert not isinstance(tensors[0].meta["val"].shape[0], int), "expected a symbolic row count"
    assert [label_output(o) for o in tensors] == [
        OutputLabel("logprob", "/ per-token"), OutputLabel("entropy", "/ 0.7"), OutputLabel("logprob")]


# ---- an online log-sum-exp over vocabulary blocks (`analysis.vocab_blocks`) -----------------------


def online_blocks(x, t, block=3, last=None, rescale=True, pick_from=0):
    """Log-prob and entropy of `x / 0.7` by blocks of `block` columns up to `last` (default: all),
    the running sums rescaled at each step (or not), the target picked from blocks `pick_from`..."""
    m = torch.full(x.shape[:-1], float("-inf"))
    s, e_x, target = torch.zeros(x.shape[:-1]), torch.zeros(x.shape[:-1]), torch.zeros(x.shape[:-1])
    for a in range(0, x.shape[-1] if last is None else last, block):
        z = x[..., a:a + block] / 0.7
        m_new = torch.maximum(m, z.amax(-1))
        e = torch.exp(z - m_new.unsqueeze(-1))
        r = torch.exp(m - m_new) if rescale else 1.0
        s, e_x, m = s * r + e.sum(-1), e_x * r + (e * z).sum(-1), m_new
        if a >= pick_from:
            inside = (t >= a) & (t < a + z.shape[-1])
            picked = z.gather(-1, (t - a).clamp(0, z.shape[-1] - 1).unsqueeze(-1))[..., 0]
            target = torch.where(inside, picked, target)
    lse = m + torch.log(s)
    return target - lse, lse - e_x / s


@pytest.mark.parametrize("layout, block", [("2d", 3), ("3d", 3), ("2d", 6)])  # 6: a last block of one column
def test_online_logsumexp_over_blocks_is_a_logprob_and_an_entropy(layout, block):
    labels = output_labels(lambda x, t: online_blocks(x, t, block=block), *inputs(layout))
    assert labels == [OutputLabel("logprob", "/ 0.7"), OutputLabel("entropy", "/ 0.7")]


@pytest.mark.parametrize("twin, entropy_kind", [
    # The last column is never read: the entropy of the columns read (as of `x[:, :6]`), and a
    # target logit missing for the tokens in the last column.
    (dict(last=V - 3), "entropy"),
    (dict(rescale=False), "rowwise"),  # the running sums are not rescaled when the max moves
    (dict(pick_from=3), "entropy"),  # the target's logit of the first block is never picked
])
def test_online_logsumexp_that_differs_is_not_labelled(twin, entropy_kind):
    logp, entropy = output_labels(lambda x, t: online_blocks(x, t, **twin), *inputs())
    assert logp.kind == "rowwise"
    assert entropy == OutputLabel(entropy_kind, "/ 0.7" if entropy_kind != "rowwise" else None)
