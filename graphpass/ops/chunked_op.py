"""The chunked, recomputing op that replaces a row-local region.

A `RegionProgram` is the region's math on one chunk of rows, in a canonical 2-D layout
(`[rows, width]` tensors, `[1, width]` row-broadcast tensors, 0-d tensors for runtime scalars).
The custom op `graphpass::rowwise_chunked(key, tensors, out_sizes)` runs a registered
program chunk by chunk and returns its outputs followed by the row statistics its backward
reads (`graphpass.ops.joint`: e.g. each row's max and log-sum-exp, O(rows) bytes). It saves only
its inputs and those statistics; its backward recomputes each chunk's wide values in one pass
and writes the chunk's gradient straight into one buffer of the input's dtype. Both per-chunk
kernels are compiled by the inner compiler, dynamic in the row count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging

import torch

from graphpass import _torch_api, kernels
from graphpass.analysis.layouts import Role
from graphpass.ops import chunk_sizes, devices, head_matmul
from graphpass.ops.head_matmul import HeadSpec
from graphpass.ops.joint import ArgSpec, JointSplit

log = logging.getLogger("graphpass")

# How an input lies over the region's rows (`graphpass.analysis.layouts`): WIDE inputs are read through
# views chunk by chunk, ROW inputs (narrow) flattened to [R, w], BCAST reshaped to [1, w], SCALAR
# passed as it is.
WIDE, ROW, BCAST, SCALAR = Role.WIDE, Role.ROW, Role.BCAST, Role.SCALAR

# fp32 [chunk, V] temporaries alive at once while a chunk's kernel runs, until a compiled kernel
# says (`RegionProgram.kernel_temporary_bytes`). Inductor fuses most kernels into passes over the
# vocabulary that keep nothing wide (the gradient is written in place), not all: JSD's keeps five;
# run op by op, about three wide values are alive at once (e.g. exp, product, gradient).
TEMPORARIES_PER_CHUNK = {"inductor": 0, "aot_eager": 3, "eager": 3}


# Part of every program's key, so that a compiled graph cached on disk by an older graphpass,
# whose ops returned other outputs, is never reused: bump it when an op's outputs or arguments
# change (the saved row statistics too).
OPS_FORMAT = 3


@dataclasses.dataclass(frozen=True)
class InputSpec:
    role: Role
    width: int  # canonical width w (1 for SCALAR)
    dtype: torch.dtype
    vocab: bool = False
    """The width is the vocabulary's, symbolic in the user's graph: `width` is its example value,
    and the op runs the program specialised to each run-time size (`RegionProgram.at_vocab`)."""


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    width: int
    dtype: torch.dtype
    rank: int  # rank of the output in the user's graph, to restore its shape
    keeps_grad: bool
    reduction: str | None = None
    """"sum" or "mean": the op returns the 0-d total of this per-row output over all rows, of
    `dtype` (only in `forward_with_gradients`, see `graphpass.analysis.summed_loss`)."""
    vocab: bool = False
    """As `InputSpec.vocab`."""


class RegionProgram:
    """A region's per-chunk math plus how to lay its inputs and outputs over rows."""

    def __init__(self, graph_module, inputs, outputs, *, chunk_size, chunk_budget_bytes, inner, device,
                 index_checks=(), gradient_free=(), frozen_heads=(), generated_kernels=True):
        self.graph_module = graph_module
        self.device = torch.device(device)  # the kernels are traced and compiled for this device
        self.inputs: list[InputSpec] = list(inputs)
        self.outputs: list[OutputSpec] = list(outputs)
        self.chunk_size = chunk_size
        self.chunk_budget_bytes = chunk_budget_bytes
        self.inner = inner
        self.generated_kernels = generated_kernels  # `Config.generated_kernels`
        # kernel kind -> why graphpass runs the inner compiler's kernel for it, not one it generated
        # (`graphpass.kernels`); absent where the generated one runs, or none was asked for.
        self.kernel_notes: dict[str, str] = {}
        self.index_checks = tuple(index_checks)  # (input position, ignore_index or None): token ids
        # Inputs the program reads only under no_grad (a teacher's logits): they get no gradient.
        self.gradient_free = tuple(gradient_free)
        # Wide inputs the op computes chunk by chunk as `hidden @ W.T`, with no gradient (a
        # teacher's lm_head under no_grad): `head_matmul.HeadSpec`s, their operands gradient-free.
        self.frozen_heads: tuple[HeadSpec, ...] = tuple(frozen_heads)
        self.frozen_positions = frozenset(h.position for h in self.frozen_heads)
        self._options = dict(chunk_size=chunk_size, chunk_budget_bytes=chunk_budget_bytes, inner=inner, device=device,
                             index_checks=index_checks, gradient_free=gradient_free, frozen_heads=frozen_heads)
        self._at_vocab: dict[int, RegionProgram] = {}
        self.key = self._content_key()
        self.split = JointSplit(graph_module, [_arg_spec(spec) for spec in self.inputs],
                                differentiable_outputs=[j for j, o in enumerate(self.outputs) if o.keeps_grad],
                                differentiable_inputs=[i for i, spec in enumerate(self.inputs)
                                                       if spec.dtype.is_floating_point and i not in self.gradient_free],
                                device=self.device)
        self._forward_kernel = None
        # Gradient kernels by (kind, active outputs, wanted inputs), kind "backward" or "fused"
        # (`JointSplit.backward` / `.fused`); graphs traced ahead wait, uncompiled, in `_traced`.
        self._gradient_kernels: dict[tuple, object] = {}
        self._traced: dict[tuple, torch.fx.GraphModule] = {}

    @property
    def symbolic_vocab(self) -> bool:
        """Whether the vocabulary's size is symbolic in the user's graph (see `InputSpec.vocab`)."""
        return any(spec.vocab for spec in [*self.inputs, *self.outputs])

    def at_vocab(self, vocab: int) -> RegionProgram:
        """This program for a run-time vocabulary size: itself at its example size (or when the
        size is static), else the same per-chunk math with kernels traced for `vocab`, built once
        per size. The per-chunk graph reads the vocabulary's size from its chunks, never a number."""
        vocab = int(vocab)
        example = next(spec.width for spec in [*self.inputs, *self.outputs] if spec.vocab) if self.symbolic_vocab else None
        if example is None or vocab == example:
            return self
        if vocab not in self._at_vocab:
            if type(self) is not RegionProgram:
                raise RuntimeError(f"graphpass: {type(self).__name__} is built for one vocabulary size")
            resize = lambda spec: dataclasses.replace(spec, width=vocab) if spec.vocab else spec
            specialised = RegionProgram(self.graph_module, [resize(s) for s in self.inputs],
                                        [resize(s) for s in self.outputs], **self._options)
            if specialised.split.saved != self.split.saved:  # the fake outputs are the example's
                raise RuntimeError(f"graphpass: the row statistics of program {self.key} depend on the vocabulary size")
            self._at_vocab[vocab] = specialised
        return self._at_vocab[vocab]

    def _content_key(self) -> str:
        # Content-addressed, so a compiled graph cached on disk by another process can only
        # ever name the same program.
        text = repr(self._identity())
        return "r" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def _identity(self) -> tuple:
        """Everything that makes this program compute what it computes (its key hashes it)."""
        return (OPS_FORMAT, self.graph_module.code, self.inputs, self.outputs,
                self.chunk_size, self.chunk_budget_bytes, self.inner, str(self.device), self.index_checks,
                self.gradient_free, self.frozen_heads, self.generated_kernels)

    @property
    def total_positions(self) -> tuple[int, ...]:
        """The outputs `forward_with_gradients` returns as totals: the reduced ones, the only ones
        that keep a gradient."""
        reduced = tuple(j for j, spec in enumerate(self.outputs) if spec.reduction is not None)
        if not reduced or any(spec.keeps_grad for j, spec in enumerate(self.outputs) if j not in reduced):
            raise RuntimeError("graphpass: a program computes its gradients in forward for its totals only")
        return reduced

    @property
    def wide_input_positions(self) -> list[int]:
        return [i for i, spec in enumerate(self.inputs) if spec.role == WIDE]

    # ---- sizes -------------------------------------------------------------------------
    def rows_per_chunk(self, rows: int, vocab: int, grad_itemsize: int = 4) -> int:
        """Rows per chunk: the configured size, else what fits `chunk_sizes`' budget for logits."""
        if self.chunk_size is not None:
            return max(1, min(self.chunk_size, rows))
        share = chunk_sizes.logits_share(devices.host_reads_are_free(self.device))
        budget = chunk_sizes.at_least_budget(rows * vocab * grad_itemsize, share, self.chunk_budget_bytes)
        per_element = 4 + self.kernel_temporary_bytes(measured_only=True) + grad_itemsize * len(self.frozen_heads)
        return chunk_sizes.fitting(budget, vocab * per_element, rows)

    def _chunk_rows(self, tensors, rows: int, vocab: int, backward: bool) -> int:
        """Rows per chunk for these inputs; here forward and backward chunk alike."""
        return self.rows_per_chunk(rows, vocab, tensors[self.wide_input_positions[0]].element_size())

    def _rows_per_call(self, kernel, tensors, rows: int, vocab: int, backward: bool) -> int:
        """Rows per call of `kernel`: every row at once for a generated kernel over given wide inputs
        when no chunk size is configured (it allocates its narrow outputs only, and each call costs
        the host a launch), else a chunk's."""
        if isinstance(kernel, kernels.rowwise.GeneratedKernel) and self.chunk_size is None \
                and not self._chunks_compute_wide_inputs():
            return rows
        return self._chunk_rows(tensors, rows, vocab, backward)

    def _chunks_compute_wide_inputs(self) -> bool:
        """True where a chunk's wide inputs are computed for it (a frozen head's logits): then its rows
        bound that memory."""
        return bool(self.frozen_heads)

    def workspace_bytes(self, rows: int, vocab: int, grad_itemsize: int = 4) -> int:
        """Transient bytes of one chunk's kernels, beyond the op's inputs and outputs (and a chunk
        of each frozen head's logits)."""
        per_element = self.kernel_temporary_bytes() + grad_itemsize * len(self.frozen_heads)
        return int(per_element * self.rows_per_chunk(rows, vocab, grad_itemsize) * vocab)

    def kernel_temporary_bytes(self, measured_only: bool = False) -> float:
        """Bytes per element of `[chunk, V]` a kernel call allocates beyond its arguments: the most
        any compiled kernel's generated code does (`_torch_api.compile_kernel`), else the estimate
        `TEMPORARIES_PER_CHUNK` (with `measured_only`, 0)."""
        kernels = [self._forward_kernel, *self._gradient_kernels.values()]
        measured = [k.temporary_bytes for k in kernels if getattr(k, "temporary_bytes", None) is not None]
        if measured:
            return max(measured)
        return 0 if measured_only else 4 * TEMPORARIES_PER_CHUNK[self.inner]

    # ---- fake ------------------------------------------------------------------------------
    def fake_outputs(self, tensors, out_sizes):
        """Empty outputs (user shapes) followed by the saved row statistics ([rows, *tail])."""
        wide = tensors[self.wide_input_positions[0]]
        outs = [torch.empty(shape, dtype=spec.dtype, device=wide.device)
                for spec, shape in zip(self.outputs, self._split_sizes(out_sizes))]
        return outs + self.empty_saved(wide)

    def fake_outputs_with_gradients(self, tensors, out_sizes, needs_grad, seeds):
        """Empty outputs of `forward_with_gradients`: outputs (reduced ones 0-d), the gradient
        carrier, then gradients."""
        device = tensors[self.wide_input_positions[0]].device
        outs = [torch.empty(() if spec.reduction else shape, dtype=spec.dtype, device=device)
                for spec, shape in zip(self.outputs, self._split_sizes(out_sizes))]
        return outs + [torch.empty_like(seeds[0])] + [empty_gradient(t) for t, need in zip(tensors, needs_grad) if need]

    def empty_saved(self, wide):
        """Empty buffers, one row per row of the wide input `wide`, for the saved row statistics."""
        rows = wide.numel() // wide.shape[-1]
        return [torch.empty((rows, *spec.tail), dtype=spec.dtype, device=wide.device) for spec in self.split.saved]

    def _split_sizes(self, out_sizes):
        sizes, start = [], 0
        for spec in self.outputs:
            sizes.append(list(out_sizes[start:start + spec.rank]))
            start += spec.rank
        return sizes

    # ---- layout ------------------------------------------------------------------------
    def _layout(self, tensors):
        """(rows R, vocab V, blocks) where each block is (row offset, row count, wide 2-D views)."""
        wide = [tensors[i] for i in self.wide_input_positions]
        vocab = self._vocab(tensors)
        rows = wide[0].numel() // wide[0].shape[-1] if wide[0].shape[-1] else 0
        try:
            return rows, vocab, [(0, rows, [w.view(rows, w.shape[-1]) for w in wide])]
        except RuntimeError:
            pass
        # A strided view such as logits[:, :-1]: walk its leading dims, each slice is a 2-D view
        # (a frozen head's hidden states, `[..., H]`, alike).
        if any(w.shape[:-1] != wide[0].shape[:-1] for w in wide):
            return rows, vocab, [(0, rows, [w.reshape(rows, w.shape[-1]) for w in wide])]
        lead, inner_rows = wide[0].shape[:-2], wide[0].shape[-2]
        blocks = []
        for n, index in enumerate(itertools.product(*map(range, lead))):
            blocks.append((n * inner_rows, inner_rows, [w[index] for w in wide]))
        return rows, vocab, blocks

    def _vocab(self, tensors) -> int:
        """V: the last size of a wide input given as a tensor, else a frozen head's."""
        given = [i for i in self.wide_input_positions if i not in self.frozen_positions]
        return tensors[given[0]].shape[-1] if given else head_matmul.vocab(self.frozen_heads[0], tensors)

    def _canonical(self, tensor, spec: InputSpec, rows: int):
        if spec.role == ROW:
            return tensor.reshape(rows, spec.width)
        if spec.role == BCAST:
            return tensor.reshape(1, spec.width)
        return tensor

    def _chunks(self, tensors, rows, blocks, chunk):
        """Yield (row slice, per-chunk canonical arguments) covering all rows in order."""
        flat = [None if spec.role == WIDE else self._canonical(t, spec, rows)
                for t, spec in zip(tensors, self.inputs)]
        for offset, count, wide_views in blocks:
            for start in range(0, count, chunk):
                stop = min(count, start + chunk)
                sl = slice(offset + start, offset + stop)
                views = iter(wide_views)
                args = []
                for spec, t in zip(self.inputs, flat):
                    if spec.role == WIDE:
                        args.append(next(views)[start:stop])
                    elif spec.role == ROW:
                        args.append(t[sl])
                    else:
                        args.append(t)
                yield sl, args

    # ---- forward -----------------------------------------------------------------------
    def forward(self, tensors, out_sizes):
        """The outputs in the user's shapes, then the saved row statistics."""
        rows, vocab, blocks = self._layout(tensors)
        self._check_token_ids(tensors, vocab)
        wide = tensors[self.wide_input_positions[0]]
        outs = [torch.empty(rows, spec.width, dtype=spec.dtype, device=wide.device) for spec in self.outputs]
        outs += self.empty_saved(wide)
        if rows:
            # First: compiling it (for the chunk's rows as far as known) tells its temporaries.
            kernel = self._get_forward_kernel(self._chunk_rows(tensors, rows, vocab, backward=False))
            chunk = self._rows_per_call(kernel, tensors, rows, vocab, backward=False)
            with torch.no_grad():
                for sl, args in self._chunks(tensors, rows, blocks, chunk):
                    for out, value in zip(outs, kernel(*self._kernel_args(tensors, args, sl))):
                        out[sl] = value
        n = len(self.outputs)
        return [o.reshape(shape) for o, shape in zip(outs, self._split_sizes(out_sizes))] + outs[n:]

    def _check_token_ids(self, tensors, vocab):
        """Raise a clear error for a token id outside [0, V), as eager does, never gather garbage
        (on an accelerator a device-side assert, as eager's gather there)."""
        for position, ignore_index in self.index_checks:
            ids = tensors[position]
            bad = (ids < 0) | (ids >= vocab)
            if ignore_index is not None:
                bad &= ids != ignore_index

            def describe(ids=ids, bad=bad):
                return IndexError(f"graphpass: token id {ids[bad].flatten()[0].item()} is outside the vocabulary "
                                  f"[0, {vocab}); check the targets/labels passed to the loss")

            devices.check(~bad.any(), describe, f"graphpass: a token id is outside the vocabulary [0, {vocab}); "
                                                "check the targets/labels passed to the loss")

    def _get_forward_kernel(self, rows: int | None = None):
        if self._forward_kernel is None:
            self._forward_kernel = self._generated("forward", self.split.forward) \
                or self._compile(self.split.forward, rows=rows)
        return self._forward_kernel

    def _compile(self, graph_module, measure: bool = True, fallback=None, rows: int | None = None):
        """The inner compiler's kernel; with `measure`, compiled at once to learn its temporaries
        (`kernel_temporary_bytes`): a kernel over vocabulary tiles is not (its width is the tile's).
        `rows`: the rows of the chunks it will run, where known (`_torch_api.compile_kernel`).
        Where the compiler fails, `fallback()` gives the kernel instead (else the graph runs uncompiled)."""
        # Regenerate the module's code now, at run time: code generated while Dynamo was
        # compiling the user's graph is on Dynamo's skip list and would not compile.
        graph_module.recompile()
        width = next((spec.width for spec in self.inputs if spec.role == WIDE), None) if measure else None
        return _torch_api.compile_kernel(graph_module, self.inner, wide_width=width, fallback=fallback, rows=rows)

    def _generated(self, kind: str, graph_module):
        """The kernel `graphpass.kernels` generates for `graph_module` (a `kind` of kernel), compiled
        and run once on zeros, or None, the reason in `kernel_notes`."""
        reason = kernels.unavailable(self.device, self.generated_kernels)
        if reason is None:
            try:
                kernel = kernels.generate(graph_module, kind)
                kernel.compile_now(self.device)
                kernel.temporary_bytes = 0  # it allocates nothing but its outputs
                return kernel
            except kernels.NotGenerated as e:
                reason = str(e)
            except Exception as e:  # noqa: BLE001 - Triton failed on it: the inner compiler's kernel runs
                reason = f"Triton could not compile or run it: {type(e).__name__}: {e}".splitlines()[0]
            log.info("graphpass: the %s kernel of region program %s is compiled by %s, not generated: %s",
                     kind, self.key, self.inner, reason)
        self.kernel_notes[kind] = reason
        return None

    def _backward_in_two(self, active, wanted):
        """The backward kernel as two compiled kernels (`JointSplit.backward_in_two`), one callable
        with its arguments: the row reductions first, then the rest, which reads them."""
        reductions, rest = (self._compile(g, measure=False) for g in self.split.backward_in_two(active, wanted))
        n_out_slices = sum(1 for i in wanted if self.split.args[i].per_row)

        def backward(*args):
            inputs = args[:len(args) - n_out_slices]
            return rest(*inputs, *reductions(*args), *args[len(inputs):])

        return backward

    # ---- forward and backward in one pass ------------------------------------------------
    def forward_with_gradients(self, tensors, out_sizes, needs_grad, seeds):
        """The outputs (reduced ones as their 0-d totals), a -0.0 of the seeds' dtype that carries
        the gradient, then the gradient of each input flagged in `needs_grad` for the totals'
        gradients `seeds` (0-d): one kernel per chunk computes both (`JointSplit.fused`), reading
        each wide row once, so nothing is recomputed later."""
        rows, vocab, blocks = self._layout(tensors)
        self._check_token_ids(tensors, vocab)
        wide = tensors[self.wide_input_positions[0]]
        device = wide.device
        reduced = self.total_positions
        outs = [None if spec.reduction else torch.empty(rows, spec.width, dtype=spec.dtype, device=device)
                for spec in self.outputs]
        # Chunk totals summed in float64: the loss rounds once, like a single sum.
        totals = {j: torch.zeros((), dtype=torch.float64, device=device) for j in reduced}
        wanted = self._kernel_wanted(needs_grad)
        grads = [None] * len(tensors)
        if rows:
            row_seeds = [self._row_seed(self.outputs[j], seed, rows, device) for j, seed in zip(reduced, seeds)]
            # Without gradients to compute (no input needs one) the forward kernel alone.
            hint = self._chunk_rows(tensors, rows, vocab, backward=True)
            kernel = (self._get_gradient_kernel("fused", reduced, wanted, hint) if wanted
                      else self._get_forward_kernel(hint))
            chunk = self._rows_per_call(kernel, tensors, rows, vocab, backward=True)
            sinks, sums = self._gradient_destinations(tensors, needs_grad, wanted, rows, vocab, chunk)
            n = len(self.outputs)
            with torch.no_grad():
                for sl, args in self._chunks(tensors, rows, blocks, chunk):
                    kernel_args = self._kernel_args(tensors, args, sl, sinks)
                    if wanted:
                        values = kernel(*kernel_args, *[s[sl] for s in row_seeds], *[s.slot(sl) for s in sinks])
                    else:
                        values = kernel(*kernel_args)
                    for j, value in enumerate(values[:n]):
                        if j in totals:
                            totals[j] += value.sum(dtype=torch.float64)
                        else:
                            outs[j][sl] = value
                    if wanted:
                        for sink in sinks:
                            sink.take(sl, args)
                        for (_, acc), g in zip(sums, values[n:]):
                            acc += g
                    # Views of the chunk's wide values: the next chunk may start a new block, and
                    # the finished block must be freed before that one is allocated.
                    del kernel_args, values
            self._collect_gradients(tensors, grads, sinks, sums)
        for j, total in totals.items():
            if self.outputs[j].reduction == "mean":
                total /= rows * self.outputs[j].width  # no rows: nan, the mean of nothing, as torch's
            outs[j] = total.to(self.outputs[j].dtype)
        result = [o if j in totals else o.reshape(shape)
                  for j, (o, shape) in enumerate(zip(outs, self._split_sizes(out_sizes)))]
        carrier = torch.full((), -0.0, dtype=seeds[0].dtype, device=seeds[0].device)
        return result + [carrier] + [empty_gradient(t).zero_() if g is None else g
                                     for t, g, need in zip(tensors, grads, needs_grad) if need]

    @staticmethod
    def _row_seed(spec: OutputSpec, seed, rows, device):
        """The gradient every row of a reduced output gets from its total's gradient `seed`."""
        if spec.reduction == "mean":
            seed = seed / (rows * spec.width)
        return seed.to(device=device, dtype=spec.dtype).expand(rows, spec.width).contiguous()

    # ---- backward ----------------------------------------------------------------------
    def backward(self, tensors, saved, needs_grad, grad_outputs):
        """Gradients for `tensors` (None where not needed), recomputed chunk by chunk."""
        active = self._active_outputs(grad_outputs)
        wanted = self._kernel_wanted(needs_grad)
        grads = [None] * len(tensors)
        if not active or not wanted:
            return grads
        rows, vocab, blocks = self._layout(tensors)
        flat_grad_outputs = [grad_outputs[i].reshape(rows, self.outputs[i].width) for i in active]
        # First: compiling it (for the chunk's rows as far as known) tells its temporaries.
        kernel = self._get_gradient_kernel("backward", active, wanted, self._chunk_rows(tensors, rows, vocab, True))
        chunk = self._rows_per_call(kernel, tensors, rows, vocab, backward=True)
        row_values = [*saved, *flat_grad_outputs]
        sinks, totals = self._gradient_destinations(tensors, needs_grad, wanted, rows, vocab, chunk,
                                                    backward=(active, row_values))
        for sl, args in self._chunks(tensors, rows, blocks, chunk):
            chunk_sums = kernel(*self._kernel_args(tensors, args, sl, sinks), *[v[sl] for v in row_values],
                                *[sink.slot(sl) for sink in sinks])
            for sink in sinks:
                sink.take(sl, args)
            for (_, total), g in zip(totals, chunk_sums):
                total += g
        self._collect_gradients(tensors, grads, sinks, totals)
        return grads

    def _active_outputs(self, grad_outputs) -> tuple[int, ...]:
        """The outputs whose gradient the backward computes with: an output whose incoming
        gradient is absent or all zero contributes nothing, so its recompute is skipped (this is
        how an entropy returned only for logging costs nothing here; on an accelerator only an
        absent one is skipped, see `devices.known_zero`)."""
        return tuple(i for i, (spec, g) in enumerate(zip(self.outputs, grad_outputs))
                     if spec.keeps_grad and not devices.known_zero(g))

    def _gradient_destinations(self, tensors, needs_grad, wanted, rows, vocab, chunk, backward=None):
        """Where the backward kernel's gradients of the `wanted` inputs go: per-row inputs get theirs
        written in place, chunk by chunk (sinks: one buffer of their dtype, see `_GradBuffer`); a
        broadcast input's is a sum over chunks, `(position, total)`, in fp32 at least (a float64
        input sums in float64). `backward`: in the backward, (its active outputs, the row values
        its kernel reads: the saved statistics, then the active outputs' gradients, `[rows, ...]`)."""
        in_place = [i for i in wanted if self.inputs[i].role in (WIDE, ROW)]
        sinks = [self._gradient_sink(i, tensors, needs_grad, rows, vocab, chunk, backward) for i in in_place]
        totals = [(i, torch.zeros(self._canonical(tensors[i], self.inputs[i], rows).shape,
                                  dtype=torch.promote_types(tensors[i].dtype, torch.float32), device=tensors[i].device))
                  for i in wanted if i not in in_place]
        return sinks, totals

    def _collect_gradients(self, tensors, grads, sinks, totals) -> None:
        """Fill `grads` from the destinations of `_gradient_destinations`, once every chunk ran."""
        for sink in sinks:
            sink.finish(grads)
        for i, total in totals:
            grads[i] = total.reshape(tensors[i].shape).to(tensors[i].dtype)

    # ---- hooks: what a chunk's kernel reads and where its gradients go (`ops.lm_head`) ------
    def _kernel_args(self, tensors, args, sl, sinks=()):
        """The kernel's arguments for the chunk of rows `sl`, from the chunk's views of the op's
        inputs (`sinks`: the backward's gradient sinks, none in forward)."""
        return self._with_frozen_logits(tensors, args)

    def _with_frozen_logits(self, tensors, args, columns: slice = slice(None)) -> list:
        """A copy of `args` with each frozen head's hidden-state chunk replaced by its logits
        (`columns` of them)."""
        args = list(args)
        for head in self.frozen_heads:
            args[head.position] = head_matmul.logits(head, tensors, args[head.position], columns=columns)
        return args

    def _kernel_wanted(self, needs_grad) -> tuple[int, ...]:
        """The kernel inputs whose gradient the backward kernel computes."""
        return tuple(i for i, need in enumerate(needs_grad) if need)

    def _gradient_sink(self, i, tensors, needs_grad, rows, vocab, chunk, backward=None):
        """Where the backward kernel writes kernel input `i`'s per-row gradient (`backward`: as in
        `_gradient_destinations`)."""
        return _GradBuffer(i, tensors[i], rows)

    def _get_gradient_kernel(self, kind: str, active, wanted, rows: int | None = None):
        key = (kind, active, wanted)
        if key not in self._gradient_kernels:
            graph = self._traced.pop(key, None) or getattr(self.split, kind)(active, wanted)
            fallback = (lambda: self._backward_in_two(active, wanted)) if kind == "backward" else None
            self._gradient_kernels[key] = self._generated(kind, graph) or self._compile(
                graph, measure=kind != "column_tile", fallback=fallback, rows=rows)
        return self._gradient_kernels[key]

    def prepare_gradients_in_forward(self, needs_grad) -> None:
        """Trace now (at compile time) the kernel `forward_with_gradients` runs: traced lazily, it
        would be traced inside the compiled forward, where autograd is dispatched below."""
        wanted = self._kernel_wanted(needs_grad)
        key = ("fused", self.total_positions, wanted)
        if wanted and key not in self._gradient_kernels and key not in self._traced:
            self._traced[key] = self.split.fused(*key[1:])


def empty_gradient(t: torch.Tensor) -> torch.Tensor:
    """A buffer for `t`'s gradient as the ops return every gradient: contiguous, whatever `t`'s
    strides (a permuted or column-major input too), so fake and real kernels agree on strides."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


class _GradBuffer:
    """An input's gradient, written in place chunk by chunk into one buffer of its dtype."""

    def __init__(self, position, tensor, rows):
        self.position = position
        self.buffer = empty_gradient(tensor)
        self.flat = self.buffer.view(rows, -1)

    def slot(self, sl):
        """The kernel's out slice for the chunk's rows `sl`."""
        return self.flat[sl]

    def take(self, sl, args):
        """After the kernel wrote the chunk's slot (nothing to do: it wrote the gradient itself)."""

    def finish(self, grads):
        grads[self.position] = self.buffer


def _arg_spec(spec: InputSpec) -> ArgSpec:
    """How the joint trace sees one per-chunk argument."""
    shape = {WIDE: (1, spec.width), ROW: (1, spec.width), BCAST: (1, spec.width), SCALAR: ()}[spec.role]
    return ArgSpec(shape, spec.dtype, per_row=spec.role in (WIDE, ROW), wide=spec.role == WIDE)


# ---- registry and the custom op ------------------------------------------------------------
_PROGRAMS: dict[str, RegionProgram] = {}


def register(program_: RegionProgram) -> str:
    """Make a program callable by the op; returns its key."""
    _PROGRAMS.setdefault(program_.key, program_)
    return program_.key


def program(key: str, tensors=None) -> RegionProgram:
    """The registered program; given the op's (real) `tensors`, specialised to their vocabulary."""
    try:
        found = _PROGRAMS[key]
    except KeyError:
        raise RuntimeError(f"graphpass: region program {key} is not registered in this process; "
                           "recompile the function with backend='graphpass'") from None
    return found.at_vocab(found._vocab(tensors)) if tensors is not None and found.symbolic_vocab else found


@torch.library.custom_op("graphpass::rowwise_chunked", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def rowwise_chunked(key: str, tensors: list[torch.Tensor], out_sizes: list[int]) -> list[torch.Tensor]:
    """Run a registered row-local region chunk by chunk; see `RegionProgram`."""
    return program(key, tensors).forward(tensors, out_sizes)


@rowwise_chunked.register_fake
def _(key, tensors, out_sizes):
    return program(key).fake_outputs(tensors, out_sizes)


@torch.library.custom_op("graphpass::rowwise_chunked_backward", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def rowwise_chunked_backward(key: str, tensors: list[torch.Tensor], saved: list[torch.Tensor],
                             grad_outputs: list[torch.Tensor | None], needs_grad: list[bool]) -> list[torch.Tensor]:
    """Gradients of the inputs flagged in `needs_grad`, in order; see `RegionProgram.backward`."""
    grads = program(key, tensors).backward(tensors, saved, needs_grad, grad_outputs)
    return [empty_gradient(t).zero_() if g is None else g
            for t, g, need in zip(tensors, grads, needs_grad) if need]


@rowwise_chunked_backward.register_fake
def _(key, tensors, saved, grad_outputs, needs_grad):
    return [empty_gradient(t) for t, need in zip(tensors, needs_grad) if need]


def _setup_context(ctx, inputs, output):
    key, tensors, _ = inputs
    prog = program(key)
    n = len(prog.outputs)
    ctx.key = key
    ctx.n_outputs = n
    ctx.needs_grad = [t.requires_grad and t.is_floating_point() and i not in prog.gradient_free
                      for i, t in enumerate(tensors)]
    ctx.save_for_backward(*tensors, *output[n:])
    forward_only = [o for o, spec in zip(output, prog.outputs) if not spec.keeps_grad] + list(output[n:])
    if forward_only:
        ctx.mark_non_differentiable(*forward_only)


def _backward(ctx, grad_outputs):
    # The backward is an op of its own, so that a compiler tracing this autograd formula sees
    # one opaque call rather than the chunk loop.
    saved = list(ctx.saved_tensors)
    tensors, stats = saved[:len(ctx.needs_grad)], saved[len(ctx.needs_grad):]
    grads = iter(rowwise_chunked_backward(ctx.key, tensors, stats, list(grad_outputs[:ctx.n_outputs]),
                                          ctx.needs_grad))
    per_input = [next(grads) if need else None for need in ctx.needs_grad]
    return None, per_input, None


rowwise_chunked.register_autograd(_backward, setup_context=_setup_context)
