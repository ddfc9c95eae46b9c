"""The chunked op with the lm_head inside: the logits `[rows, V]` are never stored.

`LinearHeadProgram` is a `RegionProgram` whose wide input is not a tensor but a product: the op
takes `hidden [*rows, H]` where the region read the logits, and the weight (and bias) after the
region's own inputs. The base class's row loops are unchanged; this class says what a chunk's
wide value is and where its gradient goes, and adds one schedule of its own, over vocabulary tiles:

- forward, per chunk: `logits_c = hidden_c @ W.T (+ b)`, then the region's forward kernel (its
  outputs and O(rows) row statistics, as for logits given as a tensor);
- row blocks (the base's loop): per block of rows, the block's logits; the region's gradient
  kernel overwrites them with their `dlogits` (the logits are its temporary,
  `JointSplit.overwritten`: no scratch, no copy); then `dhidden[block] = dlogits @ W` (complete: one
  GEMM over the whole vocabulary) and `dW += dlogits.T @ hidden[block]` (and `db += dlogits.sum(0)`)
  into fp32 accumulators, converted to the weight's dtype at the end (for an fp32 weight the
  accumulator is the gradient itself);
- vocabulary tiles (`_tile_pass`): the weight's gradient needs no accumulator when the tiles are
  outermost. Each row's statistics being known (saved by the forward), a column-tile kernel
  (`JointSplit.column_tile`) gives a tile's `dlogits` for all rows, so `dW[tile] = dlogits.T @
  hidden` is complete in one GEMM and written once in the weight's dtype; `dhidden` then
  accumulates over tiles, `[rows, H]`. Sums the backward itself takes along the vocabulary (a
  distillation KL's log-softmax backward sums the teacher's probabilities) are read by the tile
  kernel too (`JointSplit.carried`): only a pass over whole rows before it can write them, so the
  backward alone takes row blocks for such a program, the two passes below tiles.

Which gradient accumulates is chosen by shapes: the backward (a loss outside the op) takes tiles
when the weight needs a gradient, no other input does and rows <= V (the hidden states'
accumulator is the smaller); else row blocks. On the CPU, for a weight narrower than fp32, it
may take both instead where one would accumulate (row blocks for every gradient but the weight's,
then tiles for the weight's): the CPU's mm has no fp32 output for bf16 operands, so one pass
multiplies fp32 copies into its accumulator. Which is faster depends on the processor (a product
of fp32 copies ran 9 x slower than the bf16 one on a Xeon with AMX, 4-7 x on an AMD EPYC with
AVX512-BF16), so the schedule is chosen by this machine's measured GEMM rates
(`LinearHeadProgram._two_passes_pay`, `gemm_rates`), one pass only where its fp32 accumulator fits
the backward's budget. Where the loss is one sum of per-token terms the
op computes the gradients in its forward (`RegionProgram.forward_with_gradients`): one pass over
row blocks, three GEMMs. For a weight narrower than fp32 its fp32 accumulator would be twice its
gradient (beyond the backward's budget unless the weight is small or rows >= 15 V), so that
forward makes two passes instead (no accumulator): row blocks for `dhidden` (complete per block) whose fused kernel also writes each row's statistics and the backward's
own row sums (`JointSplit.fused_saving`), then vocabulary tiles for `dW` (complete per tile). The first pass
keeps the last entries' dlogits in the weight gradient's buffer, which exists but is not written
until the second (`LinearHeadProgram.kept_columns`), so the second multiplies those at once and
recomputes only the others' logits: 4 - kept/V GEMMs (3.56 at T=2048, H=1024, V=32768: 44 % kept;
the bf16 PPO step's CPU time went from 1.05 x inductor's to 0.96 x, alternating in one process).

Peak beyond the gradients: a block (or a tile) of `[rows, V]`, plus the accumulator
(none in two passes; `[V, H]` or `[rows, H]` fp32 for a narrower weight); a bf16 weight is
multiplied as it is, never copied to fp32, except on the CPU where an accumulating product is
computed in fp32 (`devices.mm_into`).
"""

from __future__ import annotations

import logging

import torch

from graphpass.ops import chunk_sizes, devices, gemm_rates, head_matmul
from graphpass.ops.chunked_op import BCAST, WIDE, RegionProgram, empty_gradient
from graphpass.ops.head_matmul import HeadSpec
from graphpass.ops.joint import NotTileable

log = logging.getLogger("graphpass")

# Vocabulary entries per tile at least: narrower tiles make GEMMs that stream the hidden states
# once per few columns.
_MIN_TILE_COLUMNS = 256


class LinearHeadProgram(RegionProgram):
    """A region program whose wide input `head.position` is `hidden @ W.T (+ b)`, chunk by chunk."""

    keep_columns = True
    """Whether the two passes keep the last entries' dlogits in the weight gradient's buffer
    (`kept_columns`); tests turn it off to run the tiles over the whole vocabulary."""
    tiles_column_major = True
    """Whether a vocabulary tile's logits are stored `[width, rows]` (see `_tile_pass`) or
    `[rows, width]`: `bench.gpu_profile --tile-layouts` measures both on a GPU, where the column-tile
    kernel ran at a ninth of the memory's speed (bench/results/gpu_profile.md)."""

    def __init__(self, graph_module, inputs, outputs, *, head: HeadSpec, **kwargs):
        self.head = head  # before the base's __init__: the content key includes it
        self.tiles_column_major = type(self).tiles_column_major  # fixed, and in the key, from here on
        super().__init__(graph_module, inputs, outputs, **kwargs)
        # A chunk's logits are a temporary: its gradient kernels overwrite them with their gradient.
        self.split.overwritten = (head.position,)
        # The fused kernels (by wanted inputs) that also write the row values of a second pass
        # over vocabulary tiles (`prepare_gradients_in_forward`).
        self._saving_wanted: set[tuple[int, ...]] = set()
        self.tile_reasons: dict[tuple[int, ...], str] = {}
        """Why no column-tile kernel exists for these active outputs (`JointSplit.column_tile`)."""

    def _identity(self) -> tuple:
        return (*super()._identity(), self.head, self.tiles_column_major)

    # ---- sizes -------------------------------------------------------------------------
    # A block (or a tile) is one call of the region's kernel, which overwrites its logits with
    # their gradient: on a CPU that other processes share, each call is a parallel region that
    # waits for threads they hold, so fewer and longer calls (an eighth of a block each took the
    # bf16 acceptance step from 4.3 s to 8.5 s at load 3-4).

    def floor_bytes(self, rows: int, vocab: int, itemsize: int) -> int:
        """Bytes of the gradients the backward must produce (`chunk_sizes.lm_head_floor_bytes`)."""
        return chunk_sizes.lm_head_floor_bytes(rows, vocab, self.head.hidden_size, itemsize)

    def _budget(self, rows: int, vocab: int, itemsize: int, backward: bool) -> int:
        """Bytes for temporaries (`chunk_sizes`): at least `chunk_budget_bytes`, an eighth of the
        floor in backward (on top of the gradients); the floor in forward, before any gradient
        exists, so that it stays below the backward's peak while its GEMMs get rows (a block's
        `[rows, H] @ [H, V]` re-reads the weight: at H=256, V=65536, fp32, 256-row blocks ran
        97 GF/s here, 128-row ones 87, and the loss-outside step 3 % faster)."""
        share = chunk_sizes.LM_HEAD_BACKWARD_SHARE if backward else chunk_sizes.LM_HEAD_FORWARD_SHARE
        return chunk_sizes.at_least_budget(self.floor_bytes(rows, vocab, itemsize), share, self.chunk_budget_bytes)

    def block_rows(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Rows per matmul: the configured chunk size, else what keeps a block's temporaries
        within the budget (`_budget`)."""
        if self.chunk_size is not None:
            return max(1, min(self.chunk_size, rows))
        upcast = self._weight_upcast(rows, vocab, grad_itemsize)
        per_row = vocab * self._bytes_per_element(grad_itemsize, backward, upcast)
        block = chunk_sizes.fitting(self._budget(rows, vocab, grad_itemsize, backward), per_row, rows)
        return block - block % chunk_sizes.PANEL_ROWS if block >= 2 * chunk_sizes.PANEL_ROWS else block

    def tile_columns(self, rows: int, vocab: int, itemsize: int, upcast: bool) -> int:
        """Vocabulary entries per tile of all `rows`: what keeps the tile's logits (and with
        `upcast` their fp32 copy, `devices.mm_into`) within the backward's budget,
        rounded down to a power of two (each width compiles the tile kernel once, so counts of rows
        within a factor of two share it), at least `_MIN_TILE_COLUMNS`."""
        per_column = max(rows, 1) * self._bytes_per_element(itemsize, True, upcast)
        fits = chunk_sizes.fitting(self._budget(rows, vocab, itemsize, True), per_column, vocab)
        return min(vocab, max(_MIN_TILE_COLUMNS, 1 << (fits.bit_length() - 1)))

    def kept_columns(self, rows: int, vocab: int, itemsize: int) -> tuple[int, int]:
        """(kept, width): vocabulary entries, the last `kept`, whose dlogits the first of the two
        passes keeps for the second (`_KeptColumns`), and the second's tile width.

        They are kept in the weight gradient's own buffer, `[V, H]`, allocated before the first
        pass and not written until the second, so they take no memory beyond the floor: in pieces
        of `_KEPT_PIECE` entries from its start, each `[rows, piece]`. The second pass multiplies
        them first, the last piece first, `dW[piece] = dlogits.T @ hidden`: each product's rows
        must lie past every piece not yet read (`_kept_fit`), which allows about `H (V - piece) / rows`
        entries for rows >= H (all but a tile for fewer rows). Then it recomputes only the other
        entries' logits, in whole tiles: `V - kept` is a multiple of the width (no tile of
        another width, whose kernel would compile for each new count of rows); of the budget's
        width and its half, the one that keeps more. None kept for an `[H, V]` weight (its
        gradient's columns are strided over the whole buffer) or with `keep_columns` off."""
        width = self.tile_columns(rows, vocab, itemsize, upcast=False)
        if not self.keep_columns or self.head.weight_transposed or rows == 0:
            return 0, width
        hidden = self.head.hidden_size
        most = min(vocab, vocab * hidden // rows)  # all the buffer holds
        best = (0, width)
        for w in (width, width // 2) if width // 2 >= _MIN_TILE_COLUMNS else (width,):
            recomputed = -(-(vocab - most) // w) * w
            while recomputed < vocab and not _kept_fit(vocab - recomputed, rows, hidden, vocab):
                recomputed += w
            best = max(best, (max(0, vocab - recomputed), w))
        return best

    def _weight_upcast(self, rows: int, vocab: int, itemsize: int) -> bool:
        """Whether a block's weight-gradient product is computed from fp32 copies: on the CPU, for
        a weight narrower than fp32 whose gradient accumulates over row blocks (neither pass of
        two, in forward or in backward, accumulates it)."""
        return (itemsize < 4 and devices.host_reads_are_free(self.device)
                and not self._forward_in_two_passes(rows, vocab, itemsize)
                and not self._backward_in_two_passes(rows, vocab, itemsize, self._gradient_outputs()))

    def _forward_in_two_passes(self, rows: int, vocab: int, itemsize: int) -> bool:
        """Whether the gradients computed in forward take the two passes of the module doc: for a
        weight narrower than fp32 whose saving kernel traced (`prepare_gradients_in_forward`), where
        they pay (`_two_passes_pay`; one pass accumulates the weight's gradient, `[V, H]`)."""
        return bool(self._saving_wanted) and self._two_passes_pay(rows, vocab, itemsize, accumulated_rows=vocab)

    def _two_passes_pay(self, rows: int, vocab: int, itemsize: int, accumulated_rows: int) -> bool:
        """The schedule chooser for a weight narrower than fp32 on the CPU: whether two passes of
        GEMMs in its dtype (no accumulator) beat one pass whose accumulating product is computed
        from fp32 copies into an fp32 accumulator of `accumulated_rows` x H (the weight's gradient's
        over row blocks, or the hidden states' over tiles). The one pass is a candidate only where
        its accumulator fits the backward's budget (`_budget`: the bound the blocks and tiles
        take); then the faster by this machine's measured rates (`gemm_rates.measured`): two passes
        run 4 - kept/V GEMMs of 2 x rows x H x V flops natively, one pass 2 natively and 1 from
        fp32 copies (either way the product is rounded once to the dtype eager's is)."""
        if not devices.host_reads_are_free(self.device):
            return True  # an accelerator's products accumulate in fp32 natively; its rule is as before
        accumulator = accumulated_rows * self.head.hidden_size * 4
        if accumulator > self._budget(rows, vocab, itemsize, backward=True):
            return True
        rates = gemm_rates.measured(self.inputs[self.head.position].dtype)
        kept, _ = self.kept_columns(rows, vocab, itemsize)
        two_passes = (4 - kept / max(vocab, 1)) / rates.native
        return two_passes <= 2 / rates.native + 1 / rates.upcast

    def _gradient_outputs(self) -> tuple[int, ...]:
        """The outputs that can carry a gradient: the backward's active ones when all do."""
        return tuple(j for j, spec in enumerate(self.outputs) if spec.keeps_grad)

    def _bytes_per_element(self, itemsize: int, backward: bool, upcast: bool) -> float:
        """Temporary bytes per element of a block (or tile) of `[rows, V]`: the logits (a frozen
        head's too), the kernel's temporaries, with `upcast` (in backward) the logits' fp32 copy."""
        logits = itemsize * (1 + len(self.frozen_heads))  # the head's and each frozen head's
        return logits + self.kernel_temporary_bytes() + (4 if upcast and backward else 0)

    def rows_per_chunk(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Rows per call of the region's kernel: a block."""
        return self.block_rows(rows, vocab, grad_itemsize, backward)

    def _chunk_rows(self, tensors, rows: int, vocab: int, backward: bool) -> int:
        return self.rows_per_chunk(rows, vocab, tensors[self.head.weight].element_size(), backward)

    def _chunks_compute_wide_inputs(self) -> bool:
        return True  # each block's logits

    def workspace_bytes(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Transient bytes while the op runs, beyond its inputs, outputs and the gradients it returns,
        in the schedule it takes when the head's operands, and nothing else, need gradients: a
        block's logits (in backward on the CPU also their fp32 copy and a narrower weight's fp32
        accumulator), or a tile's (and the hidden states' accumulator), or in two passes the larger
        of a block's and a tile's (and a saving kernel's row values)."""
        block = self.block_rows(rows, vocab, grad_itemsize, backward)
        upcast = backward and self._weight_upcast(rows, vocab, grad_itemsize)
        blocks = int(block * vocab * self._bytes_per_element(grad_itemsize, backward, upcast))
        if not backward:
            return blocks
        active = self._gradient_outputs()
        in_forward = self._forward_in_two_passes(rows, vocab, grad_itemsize)
        if in_forward or self._backward_in_two_passes(rows, vocab, grad_itemsize, active):  # row blocks, then tiles
            width = self.tile_columns(rows, vocab, grad_itemsize, upcast=False)
            tile = int(rows * width * self._bytes_per_element(grad_itemsize, True, False))
            if not in_forward:  # the backward's row values are saved already
                return max(blocks, tile)
            carried = self.split.carried(self.total_positions, (self.head.position,))
            return max(blocks, tile) + rows * 4 * (len(self.split.saved) + len(carried)
                                                   + sum(o.width for o in self.outputs))
        narrow = grad_itemsize < 4
        if self._fused or not active or self._tiles_reason(rows, vocab, active) is not None:
            return blocks + (vocab * self.head.hidden_size * 4 if narrow else 0)
        upcast = narrow and devices.host_reads_are_free(self.device)
        width = self.tile_columns(rows, vocab, grad_itemsize, upcast)
        tile = int(rows * width * self._bytes_per_element(grad_itemsize, True, upcast))
        return tile + ((rows + (width if upcast else 0)) * self.head.hidden_size * 4 if narrow else 0)

    @property
    def _fused(self) -> bool:
        """Whether the program computes its gradients in forward (its backward never runs)."""
        return any(spec.reduction is not None for spec in self.outputs)

    # ---- layout ------------------------------------------------------------------------
    def _layout(self, tensors):
        """(rows, V, blocks) as the base's, with the hidden states `[rows, H]` as the head's view."""
        hidden = tensors[self.head.position]
        vocab = head_matmul.vocab(self.head, tensors)
        rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
        views = []
        for i in self.wide_input_positions:
            t = tensors[i]
            views.append(t.reshape(rows, t.shape[-1]))
        return rows, vocab, [(0, rows, views)]

    def _logits(self, tensors, hidden_chunk, out=None, columns: slice = slice(None)):
        """The head's logits for `hidden_chunk` (`head_matmul.logits`)."""
        return head_matmul.logits(self.head, tensors, hidden_chunk, out, columns)

    def _kernel_args(self, tensors, args, sl, sinks=()):
        args = self._with_frozen_logits(tensors, args)
        head_sinks = [sink for sink in sinks if isinstance(sink, _HeadGradients)]
        if head_sinks:  # the kernel reads the chunk's logits from its slot; a saving kernel's slots
            head_sinks[0].logits(sl)
            del args[self.head.position]
            return args + head_sinks[0].row_value_slots(sl)
        args[self.head.position] = self._logits(tensors, args[self.head.position])
        return args

    def _kernel_wanted(self, needs_grad) -> tuple[int, ...]:
        head = self.head
        operands = [head.position, head.weight] + ([head.bias] if head.bias is not None else [])
        wanted = [i for i in range(len(self.inputs)) if needs_grad[i] and i != head.position]
        if any(needs_grad[i] for i in operands):
            wanted.append(head.position)
        return tuple(sorted(wanted))

    def _gradient_sink(self, i, tensors, needs_grad, rows, vocab, chunk, backward=None):
        if i != self.head.position:
            return super()._gradient_sink(i, tensors, needs_grad, rows, vocab, chunk, backward)
        itemsize = tensors[self.head.weight].element_size()
        block = self.block_rows(rows, vocab, itemsize)
        tiles, weight_by_tiles = None, False  # the weight's gradient accumulates over the row blocks
        if backward is None and self._kernel_wanted(needs_grad) in self._saving_wanted:
            tiles = (self.total_positions, None)  # a saving kernel writes the row values
            weight_by_tiles = self._forward_in_two_passes(rows, vocab, itemsize)
        elif backward is not None and self._backward_in_two_passes(rows, vocab, itemsize, backward[0], needs_grad):
            tiles, weight_by_tiles = backward, True
        return _HeadGradients(self, tensors, needs_grad, rows, vocab, chunk, block, tiles,
                              weight_by_tiles and needs_grad[self.head.weight])

    # ---- vocabulary tiles ----------------------------------------------------------------
    def prepare_gradients_in_forward(self, needs_grad) -> None:
        """As the base's; for a weight narrower than fp32 whose gradient is wanted, the fused
        kernel also writes the row values (`JointSplit.fused_saving`) and the column-tile kernel
        is traced too, for the two passes of the module doc (each traced now, where autograd runs).
        A program whose kernels do not trace so takes one pass, the reason in `tile_reasons`."""
        head, wanted = self.head, self._kernel_wanted(needs_grad)
        key = ("fused", self.total_positions, wanted)
        narrow = self.inputs[head.position].dtype.itemsize < 4
        if narrow and needs_grad[head.weight] and key not in self._gradient_kernels and key not in self._traced:
            why = self._tile_kernel(self.total_positions)
            if why is None:
                try:
                    self._traced[key] = self.split.fused_saving(*key[1:], (head.position,))
                    self._saving_wanted.add(wanted)
                except RuntimeError as e:
                    self.tile_reasons[self.total_positions] = why = str(e)
            if why is not None:
                log.info("graphpass: the lm_head's weight gradient accumulates over row blocks: %s", why)
        super().prepare_gradients_in_forward(needs_grad)

    def _tile_kernel(self, active) -> str | None:
        """Trace the column-tile kernel for these active outputs unless it exists; None, or why
        there is none (cached in `tile_reasons`)."""
        key = ("column_tile", active, (self.head.position,))
        if active in self.tile_reasons or key in self._gradient_kernels or key in self._traced:
            return self.tile_reasons.get(active)
        try:
            self._traced[key] = self.split.column_tile(*key[1:])
        except NotTileable as e:
            self.tile_reasons[active] = f"its backward does not run on a vocabulary tile: {e}"
        return self.tile_reasons.get(active)

    def _tiles_reason(self, rows: int, vocab: int, active, needs_grad=None) -> str | None:
        """Why the backward takes row blocks, not vocabulary tiles (None: tiles). Without
        `needs_grad`: as when the head's operands, and nothing else, need gradients."""
        head = self.head
        if needs_grad is not None and not needs_grad[head.weight]:
            return "the weight needs no gradient: nothing accumulates over row blocks"
        if needs_grad is not None and self._kernel_wanted(needs_grad) != (head.position,):
            return "another input of the region needs a gradient; the column-tile kernel gives the logits' only"
        if rows > vocab:
            return "more rows than vocabulary entries: the weight's accumulator is the smaller"
        why = self._tile_kernel(active)
        if why is None and self.split.carried(active, (head.position,)):
            return "its backward sums along the vocabulary, which a tile reads from a pass over row blocks"
        return why

    def _backward_in_two_passes(self, rows: int, vocab: int, itemsize: int, active, needs_grad=None) -> bool:
        """Whether the backward takes two passes, as the forward does for gradients of a narrower
        weight (module doc): row blocks for every gradient but the weight's, then vocabulary tiles for
        the weight's, both complete in the weight's dtype. On the CPU, for a weight narrower than
        fp32, where one pass would accumulate a gradient over blocks or tiles and the two pay
        (`_two_passes_pay`): the CPU's mm has no fp32 output for bf16 operands, so `devices.mm_into`
        multiplies fp32 copies, and on a Xeon with AMX a `[2048, 4096] @ [4096, 1024]` product took
        70 ms in fp32 against 7.8 ms in bf16: the bf16 loss-outside step at T=2048, H=1024,
        V=32768 ran 1.5 x inductor's time in one pass, 0.87 x in two (`bench.lm_head --workloads
        ppo_outside --dtypes bf16 --ab`). Without `needs_grad`: as when the head's operands, and
        nothing else, need gradients."""
        head = self.head
        if not active or self._fused or itemsize >= 4 or not devices.host_reads_are_free(self.device):
            return False  # no gradient to compute, or computed in forward: no backward runs
        if needs_grad is not None and not needs_grad[head.weight]:
            return False
        if self._tile_kernel(active) is not None or self.split.carried(active, (head.position,)):
            return False  # the tiles cannot give the weight's gradient alone
        tiles = rows <= vocab and (needs_grad is None or self._kernel_wanted(needs_grad) == (head.position,))
        if tiles and needs_grad is not None and not needs_grad[head.position]:
            return False  # one pass over tiles, the weight's gradient alone: nothing accumulates
        # One pass accumulates the hidden states' gradient over tiles, or the weight's over row blocks.
        return self._two_passes_pay(rows, vocab, itemsize, accumulated_rows=rows if tiles else vocab)

    def backward(self, tensors, saved, needs_grad, grad_outputs):
        """The base's row blocks, or vocabulary tiles where `_tiles_reason` allows: `dW` complete
        tile by tile, `dhidden` accumulated (in fp32 for a narrower dtype); or both, one after the
        other (`_backward_in_two_passes`)."""
        active = self._active_outputs(grad_outputs)
        rows, vocab, _ = self._layout(tensors)
        itemsize = tensors[self.head.weight].element_size()
        if (not active or self._tiles_reason(rows, vocab, active, needs_grad) is not None
                or self._backward_in_two_passes(rows, vocab, itemsize, active, needs_grad)):
            return super().backward(tensors, saved, needs_grad, grad_outputs)  # row blocks (two passes: then tiles)
        head = self.head
        hidden, weight = tensors[head.position], tensors[head.weight]
        grads = [None] * len(tensors)
        hidden_acc = None
        if needs_grad[head.position]:
            grads[head.position] = empty_gradient(hidden)
            hidden_acc = grads[head.position].view(rows, head.hidden_size)
            acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
            if acc_dtype != hidden.dtype:
                hidden_acc = torch.empty(hidden_acc.shape, dtype=acc_dtype, device=hidden.device)
        grads[head.weight] = empty_gradient(weight)
        if head.bias is not None and needs_grad[head.bias]:
            grads[head.bias] = empty_gradient(tensors[head.bias])
        flat_grad_outputs = [grad_outputs[j].reshape(rows, self.outputs[j].width) for j in active]
        self._tile_pass(tensors, active, [*saved, *flat_grad_outputs], grads[head.weight], grads[head.bias]
                        if head.bias is not None else None, hidden_acc)
        if hidden_acc is not None and hidden_acc.dtype != hidden.dtype:
            grads[head.position].view(hidden_acc.shape).copy_(hidden_acc)
        return grads

    def _tile_pass(self, tensors, active, row_values, weight_grad, bias_grad=None, hidden_acc=None,
                   stop: int | None = None, width: int | None = None) -> None:
        """The head's gradients over vocabulary tiles of `width` columns (None: `tile_columns`),
        all rows at once, for the columns before `stop` (None: all). Per tile: its logits, overwritten with their gradient by the
        column-tile kernel for `active` (row values: the saved statistics and the active outputs'
        gradients); then `weight_grad[tile] = dlogits.T @ hidden` (one GEMM over all rows:
        complete), `bias_grad[tile] = dlogits.sum(0)` and `hidden_acc += dlogits @ W[tile]`."""
        head = self.head
        rows, vocab, blocks = self._layout(tensors)
        stop = vocab if stop is None else stop
        hidden = tensors[head.position].reshape(rows, head.hidden_size)
        weight = tensors[head.weight]
        kernel = self._get_gradient_kernel("column_tile", active, (head.position,))
        upcast = hidden_acc is not None and hidden_acc.dtype != hidden.dtype and devices.host_reads_are_free(hidden.device)
        width = width or self.tile_columns(rows, vocab, hidden.element_size(), upcast)
        chunk = self.chunk_size or rows
        # One buffer, each tile's logits in it column-major (`[width, rows]` contiguous, the last
        # tile's too): `dW[tile] = dlogits.T @ hidden` then multiplies a row-major left operand,
        # which MKL ran 15 % faster here (bf16 4096 x 2048 x 1024), and the kernel is elementwise.
        tile = torch.empty(rows * width, dtype=hidden.dtype, device=hidden.device)
        offsets = torch.arange(0, vocab, width, device=hidden.device)  # 0-d views: no host value per tile
        for k, start in enumerate(range(0, stop, width)):
            columns = slice(start, min(stop, start + width))
            n = columns.stop - start
            out = tile[:rows * n].view(n, rows).t() if self.tiles_column_major else tile[:rows * n].view(rows, n)
            logits = self._logits(tensors, hidden, out=out, columns=columns)
            for sl, args in self._chunks(tensors, rows, blocks, chunk):
                args = self._with_frozen_logits(tensors, args, columns)
                args = [a if i in self.frozen_positions else _columns(a, spec, vocab, columns)
                        for i, (a, spec) in enumerate(zip(args, self.inputs)) if i != head.position]
                kernel(*args, *[v[sl] for v in row_values], logits[sl], offsets[k])
            if head.weight_transposed:  # dW [H, V]: its tile's columns
                torch.mm(hidden.t(), logits, out=weight_grad[:, columns])
            else:
                torch.mm(logits.t(), hidden, out=weight_grad[columns])
            if bias_grad is not None:
                bias_grad[columns] = logits.sum(0, dtype=torch.promote_types(logits.dtype, torch.float32))
            if hidden_acc is not None:
                right = weight[:, columns].t() if head.weight_transposed else weight[columns]
                devices.mm_into(hidden_acc, logits, right, accumulate=k > 0)


# Vocabulary entries per piece of the kept dlogits (`LinearHeadProgram.kept_columns`): each
# piece is one `[piece, rows] @ [rows, H]` product in the second pass; a narrower piece lets more
# entries be kept (its product may start just past it).
_KEPT_PIECE = 1024


def _kept_fit(kept: int, rows: int, hidden: int, vocab: int) -> bool:
    """Whether `kept` entries' dlogits fit the weight gradient's buffer (`_KeptColumns`): piece k,
    the `n` entries after `k * _KEPT_PIECE`, holds elements up to `(k * piece + n) * rows`; its
    product writes from row `V - kept + k * piece`, and runs while pieces 0..k are unread."""
    for first in range(0, kept, _KEPT_PIECE):
        n = min(_KEPT_PIECE, kept - first)
        if (vocab - kept + first) * hidden < (first + n) * rows:
            return False
    return True


class _KeptColumns:
    """The last `kept` entries' dlogits in the front of the weight gradient's buffer (`[V, H]`,
    not written before the second pass), in pieces of `_KEPT_PIECE` entries: piece k is
    `[rows, piece]` row-major, right after piece k-1, the last piece the remainder."""

    def __init__(self, weight_grad, rows: int, vocab: int, kept: int):
        flat, piece = weight_grad.view(-1), _KEPT_PIECE
        self.start, self.piece, self.whole_count = vocab - kept, piece, kept // piece
        wide = self.whole_count * piece
        self.whole = flat[:wide * rows].view(self.whole_count, rows, piece)
        self.rest = flat[wide * rows:kept * rows].view(rows, kept - wide)

    def write(self, rows: slice, dlogits) -> None:
        """A block's kept entries, from its dlogits `[block, V]`, into their pieces' rows."""
        columns = dlogits[:, self.start:]
        wide = self.whole_count * self.piece
        if self.whole_count:  # one copy for the whole pieces
            self.whole[:, rows].copy_(columns[:, :wide].unflatten(1, (self.whole_count, self.piece)).transpose(0, 1))
        if self.rest.shape[1]:
            self.rest[rows].copy_(columns[:, wide:])

    def multiply(self, hidden, weight_grad) -> None:
        """`weight_grad[kept] = dlogits.T @ hidden`, the last piece first: each product's rows lie
        past every piece not yet read (`_kept_fit`)."""
        wide = self.start + self.whole_count * self.piece
        if self.rest.shape[1]:
            torch.mm(self.rest.t(), hidden, out=weight_grad[wide:])
        for k in reversed(range(self.whole_count)):
            first = self.start + k * self.piece
            torch.mm(self.whole[k].t(), hidden, out=weight_grad[first:first + self.piece])


def _columns(arg, spec, vocab: int, columns: slice):
    """A kernel argument's part on a vocabulary tile: a wide or `[1, V]` input's columns."""
    if spec.role == WIDE or (spec.role == BCAST and spec.width == vocab):
        return arg[:, columns]
    return arg


class _HeadGradients:
    """The head's gradients, block by block. For each block of rows: its logits, recomputed;
    the kernel, per chunk within it (a block unless `chunk_size` is set), overwrites the chunk's
    logits with their dlogits; then, with the block's dlogits complete,
    `dhidden[block] = dlogits @ W` in place and `dW += dlogits.T @ hidden[block]`,
    `db += dlogits.sum(0)` into fp32 accumulators; or, with `tiles`, `dW` over vocabulary tiles
    once every block ran (`LinearHeadProgram._tile_pass`). `tiles`: (the active outputs, the row
    values the tile kernel reads, or None where a saving kernel writes them block by block);
    `weight_by_tiles`: whether the weight's gradient is computed over the tiles (else accumulated
    over the blocks, as where a saving kernel ran in the one pass `_two_passes_pay` chose)."""

    def __init__(self, program: LinearHeadProgram, tensors, needs_grad, rows, vocab, chunk, block, tiles=None,
                 weight_by_tiles=False):
        head = self.head = program.head
        self.program, self.tensors = program, tensors
        hidden, weight = tensors[head.position], tensors[head.weight]
        self.weight = weight
        self.bias = tensors[head.bias] if head.bias is not None else None
        self.hidden = hidden.reshape(rows, hidden.shape[-1])
        self.rows, self.block = rows, max(1, block // chunk) * chunk  # whole chunks: none crosses a block
        self.start = self.stop = 0  # rows of the block whose logits are in `self.values`
        self.values = self.buffer = None
        self.vocab = vocab
        self.hidden_grad = self.weight_acc = self.bias_acc = None
        if needs_grad[head.position]:
            self.hidden_grad = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            self.hidden_flat = self.hidden_grad.view(rows, hidden.shape[-1])
        # fp32 at least: a float64 weight sums in float64.
        self.acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        # A saving kernel (`LinearHeadProgram.prepare_gradients_in_forward`) writes each row's
        # statistics and the outputs' gradients here; then `finish` computes the weight's gradient
        # over vocabulary tiles, with no accumulator. In backward they exist already.
        self.tile_active, self.row_values = tiles or ((), None)
        self.written_row_values = []
        if tiles is not None and self.row_values is None:
            device = hidden.device
            self.row_values = [torch.empty((rows, *spec.tail), dtype=spec.dtype, device=device)
                               for spec in program.split.saved]
            self.row_values += [torch.empty(rows, program.outputs[j].width, dtype=program.outputs[j].dtype,
                                            device=device) for j in program.total_positions]
            self.row_values += [torch.empty((rows, *spec.tail), dtype=spec.dtype, device=device)
                                for spec in program.split.carried(program.total_positions, (head.position,))]
            self.written_row_values = self.row_values
        self.weight_by_tiles = weight_by_tiles
        # With kept columns (`LinearHeadProgram.kept_columns`) the weight's gradient exists from
        # the start: its front holds the kept dlogits.
        self.weight_grad = self.kept = None
        self.kept_from = vocab
        kept, self.tile_width = program.kept_columns(rows, vocab, hidden.element_size())
        if kept and self.weight_by_tiles:
            self.weight_grad = empty_gradient(weight)
            self.kept_from = vocab - kept
            self.kept = _KeptColumns(self.weight_grad, rows, vocab, kept)
        if needs_grad[head.weight] and not self.weight_by_tiles:
            # Written by the first block's product, accumulated into by the others.
            self.weight_acc = torch.empty(weight.shape, dtype=self.acc_dtype, device=weight.device)
        if head.bias is not None and needs_grad[head.bias]:
            self.bias_acc = torch.zeros(self.bias.shape, dtype=self.acc_dtype, device=weight.device)
        self.first_block = True

    def logits(self, sl):
        """The logits of the chunk of rows `sl`: a view of its block's, recomputed on entering it."""
        if not self.start <= sl.start < self.stop:
            self._flush()
            self.start, self.stop = sl.start, min(self.rows, sl.start + self.block)
            if self.buffer is None:  # one block's buffer, reused by every block
                self.buffer = torch.empty(min(self.block, self.rows), self.vocab,
                                          dtype=self.hidden.dtype, device=self.hidden.device)
            self.values = self.program._logits(self.tensors, self.hidden[self.start:self.stop],
                                               out=self.buffer[:self.stop - self.start])
        if sl.stop > self.stop:
            raise RuntimeError("graphpass: an lm_head chunk crosses its block")  # chunks divide blocks
        return self.values[sl.start - self.start:sl.stop - self.start]

    def slot(self, sl):
        """The chunk's logits, which the kernel reads and overwrites with their gradient."""
        return self.values[sl.start - self.start:sl.stop - self.start]

    def row_value_slots(self, sl) -> list:
        """Where a saving kernel writes the chunk's row values (none for another kernel)."""
        return [v[sl] for v in self.written_row_values]

    def take(self, sl, args):
        """Nothing to do: the kernel wrote the chunk's dlogits over its logits."""

    def _flush(self):
        """The block's dlogits are complete: its share of every gradient."""
        if self.values is None:
            return
        dlogits, rows = self.values, slice(self.start, self.stop)
        hidden_block = self.hidden[rows]
        transposed = self.head.weight_transposed
        if self.hidden_grad is not None:
            # [block, V] @ [V, H] into the block's rows of the gradient. On the CPU for fp32
            # also as (W.T @ dlogits.T).T, whichever ran faster on the first block
            # (`devices.fastest`): on an AMD EPYC MKL streamed the weight faster as the left
            # operand (0.79 s against 0.92 s for T=1920, H=1024, V=32768 in 160-row blocks, 2
            # cores), on a Xeon slower (36 against 29 ms a 128-row block); for bf16 one GEMM
            # (88 ms against 83 ms a 224-row block on the EPYC).
            weight = self.weight.t() if transposed else self.weight
            out = self.hidden_flat[rows]

            def plain():
                return torch.mm(dlogits, weight, out=out)

            if dlogits.device.type == "cpu" and dlogits.element_size() >= 4:
                key = ("dhidden", tuple(dlogits.shape), tuple(weight.shape), dlogits.dtype)
                devices.fastest(key, (plain, lambda: out.copy_(torch.mm(weight.t(), dlogits.t()).t())))
            else:
                plain()
        if self.weight_acc is not None:
            # dW [V, H] += dlogits.T @ h, or for an [H, V] weight dW += h.T @ dlogits
            left, right = (hidden_block.t(), dlogits) if transposed else (dlogits.t(), hidden_block)
            devices.mm_into(self.weight_acc, left, right, accumulate=not self.first_block)
        if self.bias_acc is not None:
            self.bias_acc += dlogits.sum(0, dtype=self.acc_dtype)
        if self.kept is not None:
            self.kept.write(rows, dlogits)
        self.first_block = False
        self.values = None

    def finish(self, grads):
        self._flush()
        self.buffer = None
        if self.first_block and self.weight_acc is not None:  # no rows at all: nothing was written
            self.weight_acc.zero_()
        head = self.head
        if self.weight_by_tiles:
            weight_grad = empty_gradient(self.weight) if self.weight_grad is None else self.weight_grad
            if self.kept is not None:  # first: the tiles overwrite the buffer's front, where they are
                self.kept.multiply(self.hidden, weight_grad)
                self.kept = self.weight_grad = None
            grads[head.weight] = weight_grad
            self.program._tile_pass(self.tensors, self.tile_active, self.row_values, weight_grad,
                                    stop=self.kept_from, width=self.tile_width)
        if self.hidden_grad is not None:
            grads[head.position] = self.hidden_grad
        if self.weight_acc is not None:
            grads[head.weight] = self.weight_acc.to(self.weight.dtype)
        if self.bias_acc is not None:
            grads[head.bias] = self.bias_acc.to(self.bias.dtype)
