"""Random PPO/GRPO loss programs over logits, written as Python source (checked by `bench.fuzz.run`).

`generate(draw)` builds one program from a sequence of named choices: `draw(name, options)`
returns one of `options`. `random_draw(seed)` serves it from `random.Random(seed)` (a program is
fully determined by its seed), `hypothesis_draw(data)` from hypothesis, so a failing program
shrinks, and a test may script it (`lambda name, options: options[0]` is the simplest program).
Options are listed simplest first, because hypothesis shrinks towards the first one; an option
listed twice is drawn twice as often.

A program's source defines `loss(logits, tokens, ...)` (or, with an lm_head, `loss(hidden, weight,
tokens, ...)`, the logits computed first) returning `(scalar loss, *statistics)`,
`make_inputs()` returning the keyword arguments of one call, and `CHUNK_SIZE` (graphpass's
rows per chunk), so a printed program is a self-contained repro.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
Draw = Callable[[str, Sequence[T]], T]


def random_draw(seed: int) -> Draw:
    """A `draw` served by `random.Random(seed)`."""
    rng = random.Random(seed)
    return lambda name, options: rng.choice(list(options))


def hypothesis_draw(data) -> Draw:
    """A `draw` served by hypothesis's `data.draw` (from `st.data()`), so failures shrink."""
    from hypothesis import strategies as st

    return lambda name, options: data.draw(st.sampled_from(list(options)), label=name)


@dataclasses.dataclass(frozen=True)
class Program:
    """One generated loss program."""

    source: str
    choices: dict
    """Every choice made, by name (also written at the top of `source`)."""


# ---- spellings ----------------------------------------------------------------------------------
# Each is a list of source lines computing `logp` (or `ent`) from `x` [..., V] and `y` [...].
# `nan_safe`: the eager gradient stays finite when some entries of x are -inf (a vocabulary mask);
# the others compute 0 * inf there, so they are only drawn without a mask.

GATHER = ".gather(-1, y.unsqueeze(-1)).squeeze(-1)"
HIDDEN = 8  # the hidden size of programs whose loss computes the logits (`lm_head`)
FLAT_Y = "y.reshape(-1), reduction='none').view_as(y)"

LOGPROBS = {  # name: (lines, nan_safe)
    "log_softmax_gather": (["lp = torch.log_softmax(x, -1)", f"logp = lp{GATHER}"], True),
    "gather_minus_logsumexp": ([f"logp = x{GATHER} - torch.logsumexp(x, -1)"], True),
    "neg_cross_entropy": ([f"logp = -F.cross_entropy(x.reshape(-1, x.shape[-1]), {FLAT_Y}"], True),
    "neg_nll_loss": (["lp = F.log_softmax(x, dim=-1)",
                      f"logp = -F.nll_loss(lp.reshape(-1, x.shape[-1]), {FLAT_Y}"], True),
    "categorical": (["dist = torch.distributions.Categorical(logits=x)", "logp = dist.log_prob(y)"], True),
    "softmax_log_gather": ([f"logp = torch.softmax(x, -1).log(){GATHER}"], False),
    "take_along_dim": (["lp = F.log_softmax(x, -1)",
                        "logp = torch.take_along_dim(lp, y.unsqueeze(-1), dim=-1).squeeze(-1)"], True),
    # Each row's target picked by advanced indexing (`index_rows_as_gather`), on the rows flattened.
    "arange_index": (["lp = torch.log_softmax(x, -1).reshape(-1, x.shape[-1])",
                      "logp = lp[torch.arange(lp.shape[0]), y.reshape(-1)].view_as(y)"], True),
    # A log-softmax computed in place on a clone.
    "inplace_log_softmax": (["lp = x.clone()", "lp.sub_(x.amax(-1, keepdim=True))",
                             "lp.sub_(lp.exp().sum(-1, keepdim=True).log())", f"logp = lp{GATHER}"], True),
}

# How `p = softmax(x)` is spelled for the entropies that need it.
PROBS = {
    "softmax": ["p = torch.softmax(x, -1)"],
    # A manual softmax with in-place ops on clones (the forms eager autograd accepts).
    "inplace": ["p = x.clone()", "p.sub_(x.amax(-1, keepdim=True))", "p.exp_()",
                "p_sum = p.sum(-1, keepdim=True)", "p = p.clone()", "p.div_(p_sum)"],
}

ENTROPIES = {  # name: (lines, nan_safe); "{probs}" is replaced by a PROBS spelling
    "neg_sum_p_logp": (["ent = -(lp.exp() * lp).sum(-1)"], False),  # shares the log-prob's `lp`
    "softmax_times_log_softmax": (["{probs}", "ent = -(p * torch.log_softmax(x, -1)).sum(-1)"], False),
    "logsumexp_minus_expected_logit": (["{probs}", "ent = torch.logsumexp(x, -1) - (p * x).sum(-1)"], False),
    "categorical": (["ent = dist.entropy()"], True),  # shares (or makes) the Categorical
    "p_log_p_eps": (["{probs}", "ent = -(p * torch.log(p + 1e-10)).sum(-1)"], True),
    "special_entr": (["{probs}", "ent = torch.special.entr(p).sum(-1)"], False),
}

AUTOGRAD_FUNCTIONS = '''
class ScaleLogits(torch.autograd.Function):
    """x * s with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x * s

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient (a gradient-scaling layer)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None
'''


def generate(draw: Draw, data_seed: int = 0) -> Program:
    """One random loss program; `data_seed` seeds the inputs its `make_inputs()` builds."""
    choices = {}

    def pick(name, options):
        choices[name] = draw(name, options)
        return choices[name]

    # Shapes and dtype.
    layout = pick("layout", ["2d", "3d", "3d_shift"])
    dtype = pick("dtype", ["float32", "bfloat16"])
    V = pick("V", [37, 13, 50, 101, 8])
    if layout == "2d":
        rows = (pick("N", [7, 13, 1, 48, 5]),)
    else:
        rows = (pick("B", [2, 1, 3]), pick("S", [7, 5, 13, 2]))
    x_rows = rows if layout != "3d_shift" else (rows[0], rows[1] - 1)
    chunk_size = pick("chunk_size", [4, 3, 5, 7, 16])

    # What happens to the logits before the log-prob/entropy region.
    upcast = dtype == "bfloat16" and pick("upcast", [True, False])
    autograd_fn = pick("autograd_fn", [None, None, "ScaleLogits", "ScaleGrad"])
    temp_value = pick("temperature", [None, "const", "arg", "tensor"])
    temp_op = pick("temperature_op", ["div", "mul_reciprocal", "inplace_div"]) if temp_value else None
    temp_grad = temp_value == "tensor" and pick("temperature_grad", [False, True])
    vocab_mask = pick("vocab_mask", [None, None, "masked_fill", "masked_fill_"])

    # The per-token region.
    logprob = pick("logprob", [n for n, (_, safe) in LOGPROBS.items() if safe or not vocab_mask])
    entropy = pick("entropy", [None, *(n for n, (_, safe) in ENTROPIES.items() if safe or not vocab_mask)])
    probs = pick("probs", list(PROBS)) if entropy and "{probs}" in ENTROPIES[entropy][0] else None
    ent_mode = pick("entropy_mode", ["loss", "detach", "no_grad"]) if entropy else None
    ent_in_loss = entropy is not None and (ent_mode == "loss" or pick("entropy_in_loss", [False, True]))
    ent_coef = pick("entropy_coef", ["0.01", "0.0", "arg"]) if ent_in_loss else None
    loops = ["none", "none", "buffer_zeros", "buffer_empty_like", "split_cat"] + (["per_batch"] if layout != "2d" else [])
    loop = pick("loop", loops)
    # Python chunks of a loop: 2 or 3 (each chunk is its own site, and each site costs a compile).
    n_rows = x_rows[0] * (x_rows[1] if len(x_rows) > 1 else 1)
    loop_chunk = -(-n_rows // pick("loop_chunks", [2, 3])) if loop not in ("none", "per_batch") else None
    use_checkpoint = pick("checkpoint", [False, False, False, True])

    # The objective around it.
    old_policy = pick("old_policy", ["input", "detached_self", "no_grad_old_logits", "detached_old_logits"])
    objective = pick("objective", ["pg", "ppo"])
    kl = pick("kl", [False, True])
    reduction = pick("reduction", ["mean", "masked"] + (["seq_mean"] if layout != "2d" else []))
    value_head = pick("value_head", [None, None, "plain", "ScaleGrad"])
    stats = pick("stats", ["scalars", "tensors"])

    # ---- the loss function --------------------------------------------------------------------
    args = ["logits", "tokens", "adv"]
    args += ["old_logp"] if old_policy == "input" else []
    args += ["old_logits"] if old_policy.endswith("old_logits") else []
    args += ["ref_logp"] if kl else []
    args += ["mask"] if reduction != "mean" else []
    args += ["vocab_mask"] if vocab_mask else []
    args += ["temp"] if temp_value in ("arg", "tensor") else []
    args += ["ent_coef"] if ent_coef == "arg" else []
    args += ["w"] if value_head else []

    def prep(src, dst):
        """Lines turning logits `src` into the region's input `dst` (shift, upcast, scale, mask)."""
        lines = [f"{dst} = {src}[:, :-1]" if layout == "3d_shift" else f"{dst} = {src}"]
        if upcast:
            lines.append(f"{dst} = {dst}.float()")
        if autograd_fn:
            lines.append(f"{dst} = {autograd_fn}.apply({dst}, {1.5 if autograd_fn == 'ScaleLogits' else 0.5})")
        # In place only on a tensor of our own (the upcast copy, ...); the logits are a leaf.
        own = upcast or autograd_fn
        if temp_value:
            t = "0.7" if temp_value == "const" else "temp"
            if temp_op == "inplace_div":
                lines += ([] if own else [f"{dst} = {dst}.clone()"]) + [f"{dst}.div_({t})"]
                own = True
            else:
                lines.append(f"{dst} = {dst} / {t}" if temp_op == "div" else f"{dst} = {dst} * (1 / {t})")
                own = True
        if vocab_mask == "masked_fill":
            lines.append(f"{dst} = {dst}.masked_fill(vocab_mask, float('-inf'))")
        elif vocab_mask == "masked_fill_":
            lines += ([] if own else [f"{dst} = {dst}.clone()"]) + [f"{dst}.masked_fill_(vocab_mask, float('-inf'))"]
        return lines

    outs = "logp, ent" if entropy else "logp"
    per_token = [*LOGPROBS[logprob][0]]
    # Label smoothing reads every column's log-prob: a -inf column makes it -inf in eager too.
    if logprob == "neg_cross_entropy" and not vocab_mask and pick("label_smoothing", [False, True]):
        per_token = [line.replace("reduction='none'", "reduction='none', label_smoothing=0.1") for line in per_token]
    if entropy:
        ent_lines = []
        if entropy == "neg_sum_p_logp" and "lp = " not in "\n".join(per_token):
            ent_lines.append("lp = F.log_softmax(x, -1)")
        if entropy == "categorical" and logprob != "categorical":
            ent_lines.append("dist = torch.distributions.Categorical(logits=x)")
        for line in ENTROPIES[entropy][0]:
            ent_lines += PROBS[probs] if line == "{probs}" else [line]
        if ent_mode == "no_grad":
            ent_lines = ["with torch.no_grad():", *("    " + line for line in ent_lines)]
        if ent_mode == "detach":
            ent_lines.append("ent = ent.detach()")
        per_token += ent_lines
    per_token.append(f"return {outs}")

    def call(a, b):
        return f"checkpoint(per_token, {a}, {b}, use_reentrant=False)" if use_checkpoint else f"per_token({a}, {b})"

    body = prep("logits", "x")
    body.append("y = tokens[:, 1:]" if layout == "3d_shift" else "y = tokens")
    names = outs.split(", ")
    if loop == "none":
        body.append(f"{outs} = {call('x', 'y')}")
    elif loop == "per_batch":
        body += [f"{n}_parts = []" for n in names]
        body.append("for b in range(x.shape[0]):")
        body.append(f"    {', '.join(n + '_b' for n in names)} = {call('x[b]', 'y[b]')}")
        body += [f"    {n}_parts.append({n}_b)" for n in names]
        body += [f"{n} = torch.cat({n}_parts).view_as(y)" for n in names]
    else:
        c = loop_chunk
        body += ["xf, yf = x.reshape(-1, x.shape[-1]), y.reshape(-1)", "T = xf.shape[0]"]
        if loop == "split_cat":
            body += [f"{n}_parts = []" for n in names]
            body.append(f"for s in range(0, T, {c}):")
            body.append(f"    {', '.join(n + '_c' for n in names)} = {call(f'xf[s:s + {c}]', f'yf[s:s + {c}]')}")
            body += [f"    {n}_parts.append({n}_c)" for n in names]
            body += [f"{n} = torch.cat({n}_parts).view_as(y)" for n in names]
        else:
            alloc = "torch.zeros(T, device=xf.device)" if loop == "buffer_zeros" else "torch.empty_like(xf[:, 0])"
            body += [f"{n} = {alloc}" for n in names]
            body.append(f"for s in range(0, T, {c}):")
            body.append(f"    {', '.join(f'{n}[s:s + {c}]' for n in names)} = "
                        f"{call(f'xf[s:s + {c}]', f'yf[s:s + {c}]')}")
            body += [f"{n} = {n}.view_as(y)" for n in names]

    # The old policy's log-probs.
    old_call = "per_token(old_x, y)" + ("[0]" if entropy else "")
    if old_policy == "detached_self":
        body.append("old_logp = logp.detach()")
    elif old_policy == "no_grad_old_logits":
        body.append("with torch.no_grad():")
        body += ["    " + line for line in prep("old_logits", "old_x")]
        body.append(f"    old_logp = {old_call}")
    elif old_policy == "detached_old_logits":
        body += prep("old_logits", "old_x")
        body.append(f"old_logp = {old_call}.detach()")

    def reduce(v):
        return {"mean": f"{v}.mean()", "masked": f"({v} * mask).sum() / mask.sum()",
                "seq_mean": f"(({v} * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()"}[reduction]

    if objective == "pg":
        body.append("pg = -adv * logp")
    else:
        body += ["ratio = torch.exp(logp - old_logp)",
                 "pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))"]
    if kl:  # k3 estimator of KL(policy || reference)
        body += ["log_r = ref_logp - logp", "pg = pg + 0.04 * (torch.exp(log_r) - log_r - 1)"]
    body.append(f"total = {reduce('pg')}")
    if ent_in_loss:
        coef = "ent_coef" if ent_coef == "arg" else ent_coef
        body.append(f"total = total - {coef} * {reduce('ent')}")
    if value_head:
        body.append("w = ScaleGrad.apply(w, 0.5)" if value_head == "ScaleGrad" else "w = w * 1.0")
        body.append("total = total + 0.5 * ((w - adv) ** 2).mean()")
    returned = ["total"]
    if stats == "scalars":
        returned += [f"{n}.detach().float().mean()" for n in names]
        returned += ["(old_logp - logp).detach().mean()"] if objective == "ppo" else []
    else:
        returned += ["logp.detach()"] + (["ent"] if entropy else [])
    body.append(f"return ({', '.join(returned)},)")

    # The logits computed in the loss from hidden states (drawn last: earlier draws of a seed stay).
    # Not for bf16 math without an upcast: there the eager and aot_eager kernels' bf16 rounding,
    # within 2 ulps of eager's log_softmax, is amplified past the bound by an exp (the k3 KL) when
    # the float64 reference computes the logits exactly (inductor's kernels pass).
    head = pick("lm_head", [None, None, "linear", "matmul_t"]) if dtype == "float32" or upcast else None
    if head:
        args[0:1] = ["hidden", "weight"]
        body.insert(0, "logits = F.linear(hidden, weight)" if head == "linear" else "logits = hidden @ weight.t()")

    # ---- inputs -------------------------------------------------------------------------------
    def shape(dims):
        return str(tuple(dims))

    targets = "tokens[:, 1:]" if layout == "3d_shift" else "tokens"
    inputs = [
        "g = torch.Generator().manual_seed(%d)" % data_seed,
        *([f"hidden = torch.randn({shape(rows + (HIDDEN,))}, generator=g).to(torch.{dtype}).requires_grad_()",
           f"weight = (2 / {HIDDEN} ** 0.5 * torch.randn({V}, {HIDDEN}, generator=g)).to(torch.{dtype}).requires_grad_()"]
          if head else
          [f"logits = (2 * torch.randn({shape(rows + (V,))}, generator=g)).to(torch.{dtype}).requires_grad_()"]),
        f"tokens = torch.randint(0, {V}, {shape(rows)}, generator=g)",
        f"adv = torch.randn({shape(x_rows)}, generator=g)",
    ]
    if "old_logp" in args:
        inputs.append(f"old_logp = -0.5 - 3 * torch.rand({shape(x_rows)}, generator=g)")
    if "old_logits" in args:
        inputs.append(f"old_logits = (2 * torch.randn({shape(rows + (V,))}, generator=g)).to(torch.{dtype})")
    if "ref_logp" in args:
        inputs.append(f"ref_logp = -0.5 - 3 * torch.rand({shape(x_rows)}, generator=g)")
    if "mask" in args:
        inputs += [f"mask = (torch.rand({shape(x_rows)}, generator=g) > 0.3).float()",
                   "mask.view(-1)[0] = 1.0  # never an empty denominator"]
    if vocab_mask:
        # ~30% of the vocabulary in every other row, never the target: no row is fully masked.
        inputs += [f"vocab_mask = torch.rand({shape(x_rows + (V,))}, generator=g) < 0.3",
                   f"vocab_mask.view(-1, {V})[::2] = False",
                   f"vocab_mask.scatter_(-1, {targets}.unsqueeze(-1), False)"]
    if temp_value == "arg":
        inputs.append("temp = 0.7")
    elif temp_value == "tensor":
        grad = ".requires_grad_()" if temp_grad else ""
        inputs.append(f"temp = (0.5 + torch.rand({shape(x_rows + (1,))}, generator=g)){grad}")
    if ent_coef == "arg":
        inputs.append(f"ent_coef = {pick('entropy_coef_value', [0.01, 0.0])}")
    if value_head:
        inputs.append(f"w = torch.randn({shape(x_rows)}, generator=g).requires_grad_()")

    needs_fn = autograd_fn or value_head == "ScaleGrad"
    lines = [
        "# graphpass fuzz program; re-run with: python -m bench.fuzz --file THIS_FILE",
        "# choices: " + " ".join(f"{k}={v}" for k, v in choices.items()),
        "import torch",
        "import torch.nn.functional as F",
        *(["from torch.utils.checkpoint import checkpoint"] if use_checkpoint else []),
        "",
        f"CHUNK_SIZE = {chunk_size}",
        *([AUTOGRAD_FUNCTIONS] if needs_fn else [""]),
        "",
        "def per_token(x, y):",
        *("    " + line for line in per_token),
        "",
        "",
        f"def loss({', '.join(args)}):",
        *("    " + line for line in body),
        "",
        "",
        "def make_inputs():",
        *("    " + line for line in inputs),
        f"    return dict({', '.join(f'{a}={a}' for a in args)})",
        "",
    ]
    return Program("\n".join(lines), choices)
