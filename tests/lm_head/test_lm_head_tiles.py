"""The lm_head's gradients over vocabulary tiles (`graphpass.ops.lm_head`, `JointSplit.column_tile`).

Every schedule against eager and float64, values and every input's gradient: the recomputing
backward over tiles for fp32 (`dW` complete per tile, `dhidden` accumulated), in two passes for a
bf16 weight on the CPU (row blocks for `dhidden`, then tiles for `dW`: no fp32 product), gradients
in forward in two passes for a bf16 weight and in one for fp32; a
vocabulary of 300 is a tile of 256 and one of 44. Bias, an `[H, V]` weight, tied embeddings,
vocabulary and per-token masks, temperature, a loss outside the compiled function (entropy
gradient zero or not). What is not tile-able (`Categorical.entropy`'s clamp, cross-entropy's
`nll_loss`) keeps the row blocks, with the reason; and
`on_column_tile` refuses, node by node, whatever reads along the vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import graphpass
from graphpass.ops import chunked_op
from graphpass.ops import lm_head
from graphpass.ops.lm_head import LinearHeadProgram
from graphpass.ops.joint import NotTileable, on_column_tile
from tests.lm_head.test_lm_head import _batch as lm_head_batch

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

T, H, V = 13, 8, 300
# A small budget: tiles of 256 columns (the least), so V=300 makes two, the second of 44.
OPTIONS = dict(chunk_size=4, chunk_budget_bytes=4096, inner="aot_eager")


def _up(x):
    """The user's `.float()`, a no-op on the float64 reference."""
    return x if x.dtype == torch.float64 else x.float()


def ppo(hidden, weight, tokens, old_logp, adv, mask, temperature=0.7):
    lsm = torch.log_softmax(_up(F.linear(hidden, weight)) / temperature, -1)
    logp = lsm.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return ((pg - 0.01 * entropy) * mask).sum() / mask.sum()


def with_bias(hidden, weight, tokens, old_logp, adv, mask, bias):
    lsm = torch.log_softmax(_up(F.linear(hidden, weight, bias)), -1)
    logp = lsm.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return -(logp * mask).sum() + 0.1 * (entropy * adv).sum()


def categorical(hidden, weight, tokens, old_logp, adv, mask):
    """`Categorical.entropy` clamps its normalised logits: its backward sums a clamped product
    over the vocabulary, which the forward's statistics do not give."""
    logits = _up(F.linear(hidden, weight))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -(logp * mask).sum() + 0.1 * (torch.distributions.Categorical(logits=logits).entropy() * adv).sum()


def cross_entropy(hidden, weight, tokens, old_logp, adv, mask):
    """Token-mean cross-entropy (`nll_loss` after `log_softmax`), ignored tokens left out."""
    return F.cross_entropy(_up(F.linear(hidden, weight)), tokens)


def weight_hv(hidden, weight_hv, tokens, old_logp, adv, mask):
    logp = torch.log_softmax(_up(hidden @ weight_hv), -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -(logp * mask).mean()


def tied(ids, weight, tokens, old_logp, adv, mask):
    return ppo(torch.tanh(F.embedding(ids, weight)), weight, tokens, old_logp, adv, mask)


VOCAB_MASK = torch.zeros(V, dtype=torch.bool)
VOCAB_MASK[-7:] = True  # padded vocabulary entries


def masked(hidden, weight, tokens, old_logp, adv, mask, temperature):
    logits = _up(F.linear(hidden, weight)).masked_fill(VOCAB_MASK, float("-inf")) / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -(logp * mask).sum() / mask.sum()


def token_masked(hidden, weight, tokens, old_logp, adv, mask, allowed):
    logits = _up(F.linear(hidden, weight)).masked_fill(~allowed, float("-inf"))
    return -(torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1) * adv).sum()


def _batch(dtype, *, rows=T, vocab=V, weight_shape=None, bias=False):
    """tests/lm_head/test_lm_head.py's batch at these sizes, the sampled tokens off the masked entries
    and the old log-probs near this vocabulary's."""
    tensors = lm_head_batch(rows, dtype=dtype, hidden_size=H, vocab=vocab, bias=bias, weight_shape=weight_shape)
    tensors[2] %= vocab - 7
    tensors[3] -= 4
    return tensors


def _clone(tensors, dtype=None):
    out = []
    for t in tensors:
        c = t.detach().clone()
        if dtype is not None and c.is_floating_point():
            c = c.to(dtype)
        out.append(c.requires_grad_(t.requires_grad))
    return out


def _grads(fn, tensors, kwargs):
    loss = fn(*tensors, **kwargs)
    loss.backward()
    return [loss.detach()] + [t.grad for t in tensors if t.requires_grad]


def _check(fn, tensors, *, kwargs=None, compile_fn=None, **options):
    """Compiled, eager and float64: loss and every gradient; the compiled as close to float64 as
    eager is (bf16: within 1.5 x eager's error, fp32: within 1e-5 of eager). Returns the records."""
    kwargs = kwargs or {}
    backend = graphpass.Backend(**{**OPTIONS, **options})
    compiled = (compile_fn or (lambda f: torch.compile(f, backend=backend)))(fn)
    ours = _grads(compiled, tensors, kwargs)
    eager = _grads(fn, _clone(tensors), kwargs)
    exact = _grads(fn, _clone(tensors, torch.float64), kwargs)
    bf16 = tensors[0].dtype == torch.bfloat16
    for a, b, x in zip(ours, eager, exact):
        assert a.dtype == b.dtype and a.shape == b.shape
        ours_err, eager_err = (a.double() - x).abs().max(), (b.double() - x).abs().max()
        if bf16:
            assert ours_err <= 1.5 * eager_err + 1e-3 * x.abs().max(), (float(ours_err), float(eager_err))
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return backend.records


def _programs(records):
    return [chunked_op.program(s.program_key) for r in records for s in r.sites if s.lm_head]


def _schedule(program) -> str:
    """What ran: "tiles" (backward), "two passes" (row blocks, then tiles) or "rows" (row blocks only)."""
    kinds = {k[0] for k in program._gradient_kernels}
    if "column_tile" not in kinds:
        return "rows"
    return "two passes" if kinds & {"fused", "backward"} else "tiles"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """No graph and no program of another test: the kernels a program compiled are this test's."""
    torch.compiler.reset()
    monkeypatch.setattr(chunked_op, "_PROGRAMS", {})


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
MODES = [pytest.param(True, id="in-forward"), pytest.param(False, id="recomputed")]


def _expected(dtype, in_forward):
    if dtype == torch.bfloat16:  # on the CPU: one pass would accumulate a gradient from fp32 copies
        return "two passes"
    return "rows" if in_forward else "tiles"  # fp32 in forward: its accumulator is its gradient


@pytest.mark.parametrize("in_forward", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["ppo", "bias", "weight_hv", "tied", "masked", "token_masked"])
def test_tiles_match_eager_and_float64(case, dtype, in_forward):
    kwargs = {}
    if case == "bias":
        fn, tensors = with_bias, _batch(dtype, bias=True)
    elif case == "weight_hv":
        fn, tensors = weight_hv, _batch(dtype, weight_shape=(H, V))
    elif case == "tied":
        fn, tensors = tied, _batch(dtype)
        tensors[0] = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(3))
    elif case == "masked":
        fn, tensors, kwargs = masked, _batch(dtype), {"temperature": 1.3}
    elif case == "token_masked":
        fn, tensors = token_masked, _batch(dtype)
        allowed = torch.rand(T, V, generator=torch.Generator().manual_seed(4)) < 0.7
        allowed[torch.arange(T), tensors[2]] = True
        tensors.append(allowed)
    else:
        fn, tensors = ppo, _batch(dtype)
    records = _check(fn, tensors, kwargs=kwargs, gradients_in_forward=in_forward)
    (program,) = _programs(records)
    assert _schedule(program) == _expected(dtype, in_forward), program.tile_reasons
    assert records[0].sites[0].gradients_in_forward == in_forward


@pytest.mark.parametrize("ent_coef", [0.0, 0.01])
@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_outside_the_compiled_function(dtype, ent_coef):
    """`logp, ent = compiled(hidden, W, ids)` and the loss after (TRL, verl, OpenRLHF): the
    backward over tiles, with the entropy's gradient zero (not recomputed) or not."""
    def helper(hidden, weight, tokens):
        lsm = torch.log_softmax(_up(F.linear(hidden, weight)) / 0.7, -1)
        return lsm.gather(-1, tokens[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)

    def loss(helper_fn):
        def fn(hidden, weight, tokens, old_logp, adv, mask):
            logp, entropy = helper_fn(hidden, weight, tokens)
            return (-(torch.exp(logp - old_logp) * adv * mask).sum() - ent_coef * (entropy * mask).sum()) / mask.sum()
        return fn

    backend = graphpass.Backend(**OPTIONS)
    records = _check(loss(helper), _batch(dtype), compile_fn=lambda f: loss(torch.compile(helper, backend=backend)))
    assert not records and backend.records  # the records are the helper's
    (program,) = _programs(backend.records)
    assert _schedule(program) == _expected(dtype, in_forward=False)
    active = {k[1] for k in program._gradient_kernels if k[0] == "column_tile"}
    assert active == ({(0, 1)} if ent_coef else {(0,)})


def test_inductor_kernels_on_tiles():
    """The inner compiler's kernels, for one tile width and the last, narrower one."""
    for dtype, in_forward in ((torch.bfloat16, True), (torch.float32, False)):
        torch.compiler.reset()
        records = _check(ppo, _batch(dtype, rows=40), inner="inductor", gradients_in_forward=in_forward)
        (program,) = _programs(records)
        assert _schedule(program) == _expected(dtype, in_forward)


def _tile_passes(monkeypatch) -> list:
    """(stop, width) of every tile pass that runs from now on."""
    calls, original = [], LinearHeadProgram._tile_pass

    def spy(self, *args, stop=None, width=None, **kwargs):
        calls.append((stop, width))
        return original(self, *args, stop=stop, width=width, **kwargs)

    monkeypatch.setattr(LinearHeadProgram, "_tile_pass", spy)
    return calls


# The inner compiler only compiles the passes: `test_inductor_kernels_on_tiles` runs them with inductor.
@pytest.mark.parametrize("case", ["ppo", "bias", "tied", "blocks", "pieces"])
def test_two_passes_keep_the_last_columns(case, monkeypatch):
    """bf16 in forward: the first pass keeps the last entries' dlogits in the weight gradient's
    buffer, the second multiplies them first, then recomputes the other entries' logits in whole
    tiles (V=600: 88 kept in one piece, two tiles of 256; with pieces of 16 entries, 344 kept in
    22, one tile); with `keep_columns` off the tiles cover the vocabulary (256, 256, 88). Row
    blocks of 4 (chunks) or 3 rows (`blocks`: the budget's). One compile serves both settings:
    the backward reads `keep_columns` when it runs."""
    if case == "pieces":
        monkeypatch.setattr(lm_head, "_KEPT_PIECE", 16)
    calls = _tile_passes(monkeypatch)
    vocab, options, fn = 600, {}, ppo
    tensors = _batch(torch.bfloat16, vocab=vocab, bias=case == "bias")
    if case == "bias":
        fn = with_bias
    elif case == "tied":
        fn = tied
        tensors[0] = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(3))
    elif case == "blocks":
        options = dict(chunk_size=None)
    backend = graphpass.Backend(**{**OPTIONS, **options})
    compiled = torch.compile(fn, backend=backend)
    for keep in (True, False):
        monkeypatch.setattr(LinearHeadProgram, "keep_columns", keep)
        calls.clear()
        _check(fn, _clone(tensors), compile_fn=lambda f: compiled)
        (program,) = _programs(backend.records)
        assert _schedule(program) == "two passes"
        kept, width = program.kept_columns(T, vocab, 2)
        assert (kept, width) == (((344 if case == "pieces" else 88), 256) if keep else (0, 256))
        assert calls == [(vocab - kept, width)], keep


@pytest.fixture(scope="module")
def bf16_ppo_program():
    """The bf16 PPO program, compiled once for the sizing tests (each takes a shallow copy)."""
    (program,) = _programs(_check(ppo, _batch(torch.bfloat16)))
    return program


@pytest.mark.parametrize("rows,hidden,vocab", [(2048, 1024, 32768), (16384, 2048, 248320), (4096, 256, 65536),
                                               (13, 8, 300), (1, 8, 300), (5000, 8, 300), (300, 64, 300)])
def test_kept_columns_fit_the_front_of_the_weight_gradient(rows, hidden, vocab, bf16_ppo_program):
    """Kept dlogits fit the weight gradient's buffer (`_kept_fit`), the entries the tiles recompute
    are whole tiles, the tile width is the budget's or its half."""
    program = copy.copy(bf16_ppo_program)
    program.head = dataclasses.replace(program.head, hidden_size=hidden)
    kept, width = program.kept_columns(rows, vocab, 2)
    budget_width = program.tile_columns(rows, vocab, 2, upcast=False)
    assert 0 <= kept < vocab and width in (budget_width, budget_width // 2)
    assert lm_head._kept_fit(kept, rows, hidden, vocab) and rows * kept <= vocab * hidden
    assert kept == 0 or (vocab - kept) % width == 0
    if (rows, hidden, vocab) == (2048, 1024, 32768):  # the bench's: a third kept at the default budget
        program.chunk_budget_bytes, program.inner = 16 * 2**20, "inductor"
        assert program.kept_columns(rows, vocab, 2) == (14336, 2048)


@pytest.mark.parametrize("rows,hidden,vocab", [(13, 8, 600), (40, 8, 600), (5, 8, 600), (64, 64, 600), (7, 32, 600)])
def test_kept_pieces_are_read_before_their_rows_are_written(rows, hidden, vocab, monkeypatch):
    """`_KeptColumns` in a real buffer: every block's kept entries written, then the products,
    the last piece first, equal `dlogits[:, kept].T @ hidden` from a separate copy (a product
    that overwrote a piece not yet read would not)."""
    monkeypatch.setattr(lm_head, "_KEPT_PIECE", 16)
    kept = max(k for k in range(vocab) if lm_head._kept_fit(k, rows, hidden, vocab))
    assert kept > 2 * 16 + 1  # whole pieces and a remainder
    g = torch.Generator().manual_seed(6)
    dlogits, h = torch.randn(rows, vocab, generator=g), torch.randn(rows, hidden, generator=g)
    weight_grad = torch.full((vocab, hidden), float("nan"))
    pieces = lm_head._KeptColumns(weight_grad, rows, vocab, kept)
    for start in range(0, rows, 3):
        pieces.write(slice(start, min(rows, start + 3)), dlogits[start:start + 3])
    pieces.multiply(h, weight_grad)
    torch.testing.assert_close(weight_grad[vocab - kept:], dlogits[:, vocab - kept:].t() @ h)


def scaled(hidden, weight, tokens, old_logp, adv, mask, scale):
    """A learned scale per vocabulary entry: its gradient is a sum over rows, not a tile's."""
    logp = torch.log_softmax(_up(F.linear(hidden, weight)) * scale, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -(logp * adv).sum()


def test_rows_where_tiles_do_not_pay_or_apply():
    """Row blocks: a frozen weight (nothing accumulates over rows), another input of the region
    that needs a gradient, more rows than vocabulary entries; `_tiles_reason` says which."""
    frozen = _batch(torch.float32)
    frozen[1].requires_grad_(False)
    scale = _batch(torch.float32) + [torch.rand(V, generator=torch.Generator().manual_seed(5)).add(0.5).requires_grad_()]
    for fn, tensors in ((ppo, frozen), (scaled, scale), (ppo, _batch(torch.float32, rows=40, vocab=32))):
        torch.compiler.reset()
        chunked_op._PROGRAMS.clear()
        (program,) = _programs(_check(fn, tensors, gradients_in_forward=False))
        assert _schedule(program) == "rows"
    head = program.head
    needs_grad = [False] * (len(program.inputs) + 1)
    needs_grad[head.position] = needs_grad[head.weight] = True
    assert program._tiles_reason(T, V, (0, 1), needs_grad) is None
    assert "more rows" in program._tiles_reason(V + 1, V, (0, 1), needs_grad)
    needs_grad[next(i for i in range(len(program.inputs)) if i != head.position)] = True
    assert "another input" in program._tiles_reason(T, V, (0, 1), needs_grad)
    needs_grad[head.weight] = False
    assert "needs no gradient" in program._tiles_reason(T, V, (0, 1), needs_grad)


def test_bf16_backward_takes_two_passes_where_one_would_accumulate(monkeypatch):
    """bf16, recomputed, on the CPU: where one pass would accumulate a gradient over blocks or
    tiles (the hidden states' over tiles; another region input's with the weight's over blocks;
    more rows than vocabulary entries), row blocks for every gradient but the weight's, then tiles
    for the weight's, and no product from fp32 copies (`devices.mm_into`); a frozen weight keeps
    the row blocks, where nothing accumulates in fp32."""
    products = []
    monkeypatch.setattr(lm_head.devices, "mm_into", lambda *args, **kwargs: products.append(args))
    frozen = _batch(torch.bfloat16)
    frozen[1].requires_grad_(False)
    learned = torch.rand(V, generator=torch.Generator().manual_seed(5)).add(0.5).requires_grad_()
    scale = _batch(torch.bfloat16) + [learned]
    cases = (("two passes", ppo, _batch(torch.bfloat16)), ("two passes", scaled, scale),
             ("two passes", ppo, _batch(torch.bfloat16, rows=40, vocab=32)), ("rows", ppo, frozen))
    for expected, fn, tensors in cases:
        torch.compiler.reset()
        chunked_op._PROGRAMS.clear()
        (program,) = _programs(_check(fn, tensors, gradients_in_forward=False))
        assert _schedule(program) == expected
    assert not products


# fp32 copies multiplied faster than bf16 (a CPU without bf16 arithmetic): one pass pays where it fits.
UPCAST_FASTER = "native=1e10,upcast=1e11"


@pytest.mark.parametrize("case,in_forward,budget,expected", [
    ("ppo", False, 4096, "tiles"),  # the hidden states' accumulator [13, 8] fits the budget
    ("scaled", False, 4096, "two passes"),  # the weight's [300, 8] fp32 does not
    ("scaled", False, 1 << 16, "rows"),  # ... in a larger one it does
    ("more rows", False, 4096, "rows"),  # [32, 8]: no tiles, the weight's accumulator fits
    ("ppo", True, 4096, "two passes"),  # in forward the weight's accumulator, [300, 8] fp32
    ("ppo", True, 1 << 16, "rows"),
])
def test_bf16_schedule_follows_the_measured_gemm_rates(case, in_forward, budget, expected, monkeypatch):
    """Where products from fp32 copies are measured faster than bf16 ones, a bf16 weight takes
    the one pass that accumulates in fp32 (`devices.mm_into` from fp32 copies) wherever its
    accumulator fits the backward's budget, else the two passes; each schedule as close to float64
    as eager (`_check`)."""
    monkeypatch.setenv("GRAPHPASS_GEMM_RATES", UPCAST_FASTER)
    upcast = []
    mm_into = lm_head.devices.mm_into
    monkeypatch.setattr(lm_head.devices, "mm_into", lambda acc, left, *a, **k: (
        upcast.append(left.dtype != acc.dtype), mm_into(acc, left, *a, **k))[1])
    fn, tensors = ppo, _batch(torch.bfloat16)
    if case == "scaled":
        learned = torch.rand(V, generator=torch.Generator().manual_seed(5)).add(0.5).requires_grad_()
        fn, tensors = scaled, tensors + [learned]
    elif case == "more rows":
        tensors = _batch(torch.bfloat16, rows=40, vocab=32)
    (program,) = _programs(_check(fn, tensors, gradients_in_forward=in_forward, chunk_budget_bytes=budget))
    assert _schedule(program) == expected
    assert any(upcast) == (expected != "two passes")


def test_two_passes_pay_by_the_rates_and_the_accumulators_bytes(bf16_ppo_program, monkeypatch):
    """The chooser at the bench's shape (T=2048, H=1024, V=32768, 16 MiB budget): the hidden
    states' fp32 accumulator (8 MiB) fits, so the rates decide; the weight's (128 MiB) never does.
    Two passes run 4 - 14336/32768 GEMMs natively, one pass 2 natively and one from fp32 copies:
    they pay while the copies' rate is below the native one / 1.5625."""
    program = copy.copy(bf16_ppo_program)
    program.head = dataclasses.replace(program.head, hidden_size=1024)
    program.chunk_budget_bytes, program.inner = 16 * 2**20, "inductor"
    rows, vocab = 2048, 32768
    assert program.kept_columns(rows, vocab, 2)[0] == 14336
    for upcast, two_passes in ((0.63e11, True), (0.65e11, False), (1e12, False)):
        monkeypatch.setenv("GRAPHPASS_GEMM_RATES", f"native=1e11,upcast={upcast}")
        assert program._two_passes_pay(rows, vocab, 2, accumulated_rows=rows) == two_passes
        assert program._two_passes_pay(rows, vocab, 2, accumulated_rows=vocab)


@pytest.mark.parametrize("in_forward", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_backward_that_sums_along_the_vocabulary_carries_its_sums(dtype, in_forward):
    """`Categorical.entropy`'s backward sums a clamped product along each row, which no forward
    statistic gives: bf16 in forward, the first pass writes those sums and the tiles read them;
    recomputed, nothing wrote them, so row blocks, the reason saying so."""
    (program,) = _programs(_check(categorical, _batch(dtype), gradients_in_forward=in_forward))
    active = program.total_positions if in_forward else (0, 1)
    assert program.split.carried(active, (program.head.position,)), "no sum carried"
    if in_forward:
        assert _schedule(program) == _expected(dtype, in_forward), program.tile_reasons
    else:
        needs_grad = [False] * (len(program.inputs) + 1)
        needs_grad[program.head.position] = needs_grad[program.head.weight] = True
        assert _schedule(program) == "rows"
        assert "sums along the vocabulary" in program._tiles_reason(T, V, active, needs_grad)


@pytest.mark.parametrize("in_forward", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_takes_tiles_too(dtype, in_forward):
    """`F.cross_entropy` (nll_loss, decomposed in the kernels' traces: its backward's scatter of -1
    at the target is a select, the log-softmax backward's row sum of it the picked value), with
    ignored tokens: the same schedules as the PPO loss."""
    tensors = _batch(dtype)
    tensors[2][::5] = -100
    (program,) = _programs(_check(cross_entropy, tensors, gradients_in_forward=in_forward))
    assert _schedule(program) == _expected(dtype, in_forward), program.tile_reasons


def test_a_fused_kernel_without_the_saved_values_keeps_one_pass():
    """A max over the vocabulary in the loss: the fused trace computes its statistics otherwise
    than the forward's, so it cannot write them for a second pass; one pass, the reason kept."""
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logits = _up(F.linear(hidden, weight))
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        return -(logp * mask).sum() + 0.1 * (logits.amax(-1) * adv).sum()

    (program,) = _programs(_check(fn, _batch(torch.bfloat16)))
    assert _schedule(program) == "rows" and not program._saving_wanted
    assert "does not compute the saved values" in program.tile_reasons[program.total_positions]


# ---- on_column_tile, node by node ----------------------------------------------------------------
def _graph(fn, *args):
    return make_fx(fn)(*args)


def _tiled_equals_full(fn, x, *rest, width=7):
    full_out = torch.empty_like(x)
    fn(x, *rest, full_out)
    tiled = on_column_tile(_graph(fn, x, *rest, torch.empty_like(x)), x.shape[-1])
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], width):
        cols = slice(start, min(x.shape[-1], start + width))
        piece = torch.empty(x.shape[0], cols.stop - start)
        tiled(x[:, cols], *[r[:, cols] if r.ndim == 2 and r.shape[-1] == x.shape[-1] else r for r in rest],
              piece, torch.tensor(start))
        out[:, cols] = piece
    torch.testing.assert_close(out, full_out)


def test_column_wise_math_runs_on_tiles():
    x, idx, g, scale = torch.randn(3, 20), torch.randint(0, 20, (3, 1)), torch.randn(3, 1), torch.randn(1, 20)

    def fn(x, idx, g, scale, out):
        pick = torch.where(torch.arange(20) == idx, g, 0)
        out.copy_((x.exp() * scale + pick + g.expand(3, 20) + torch.full((3, 20), 0.5)).to(torch.bfloat16).float())

    _tiled_equals_full(fn, x, idx, g, scale)


@pytest.mark.parametrize("body,why", [
    (lambda x, out: out.copy_(x - x.sum(-1, keepdim=True)), "reduces or moves"),
    (lambda x, out: out.copy_(x * x.amax(-1, keepdim=True)), "reduces or moves"),
    (lambda x, out: out.copy_(x.flip(-1)), "reduces or moves"),
    (lambda x, out: out.copy_(x.cumsum(-1)), "reduces or moves"),
    (lambda x, out: out.copy_(x.view(3, 4, 5).transpose(1, 2).reshape(3, 20)), "reduces or moves"),
    (lambda x, out: out.copy_(x.view(3, 20) * 2), "vocabulary in its shape"),
    (lambda x, out: out.copy_(x + torch.zeros(3, 20)), "vocabulary in its shape"),
    (lambda x, out: out.copy_(x + torch.rand(3, 1)), "random numbers"),
])
def test_whatever_reads_along_the_vocabulary_is_refused(body, why):
    with pytest.raises(NotTileable, match=why):
        on_column_tile(_graph(body, torch.randn(3, 20), torch.empty(3, 20)), 20)


def test_a_graph_returning_a_sum_over_rows_is_refused():
    with pytest.raises(NotTileable, match="returns"):
        on_column_tile(_graph(lambda x, g, out: (out.copy_(x), g * 2)[1], torch.randn(3, 20), torch.randn(3, 1),
                              torch.empty(3, 20)), 20)


def test_an_overwritten_argument_is_read_before_its_gradient_replaces_it():
    """`JointSplit.overwritten`: the fused kernel reads the logits from the slot it overwrites with
    their gradient; an output that is a view of them is copied first, so it is still the logits."""
    from graphpass.ops.joint import ArgSpec, JointSplit

    class FirstColumnAndLogsumexp(torch.nn.Module):
        def forward(self, logits):
            return logits[:, :1], torch.logsumexp(logits, -1, keepdim=True)

    logits = torch.randn(4, 20, requires_grad=True)
    split = JointSplit(torch.fx.symbolic_trace(FirstColumnAndLogsumexp()), [ArgSpec((1, 20), torch.float32, True, True)],
                       [1], [0], device=torch.device("cpu"))
    split.overwritten = (0,)
    fused = split.fused((1,), (0,))
    assert [n.name for n in fused.graph.find_nodes(op="placeholder")] == ["grad_out1", "grad_in0"]
    grad_out, slot = torch.randn(4, 1), logits.detach().clone()
    column, lse = fused(grad_out, slot)
    torch.testing.assert_close(column, logits[:, :1].detach())
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1, keepdim=True).detach())
    (expected,) = torch.autograd.grad(torch.logsumexp(logits, -1, keepdim=True), logits, grad_out)
    torch.testing.assert_close(slot, expected)


@pytest.mark.parametrize("column_major", [True, False], ids=["width-rows", "rows-width"])
def test_either_tile_layout_gives_the_same_gradients(column_major, monkeypatch):
    """A tile's logits stored `[width, rows]` (the default) or `[rows, width]`
    (`LinearHeadProgram.tiles_column_major`, for measuring on a GPU): values and gradients as
    eager's, each layout a program of its own (its key holds the layout)."""
    monkeypatch.setattr(LinearHeadProgram, "tiles_column_major", column_major)
    (program,) = _programs(_check(ppo, _batch(torch.bfloat16, vocab=600)))
    assert program.tiles_column_major is column_major and _schedule(program) == "two passes"
