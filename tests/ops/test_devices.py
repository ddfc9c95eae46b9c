"""The accelerator path, tested without one: every op on the device of its inputs, no host sync.

The CPU build of torch cannot run autograd on fake CUDA tensors (it aborts the process), so the
`meta` device stands in for CUDA: graphpass takes its accelerator path on every device but the
CPU (`graphpass.ops.devices`), a `cpu` tensor mixed into a meta op raises at once, and reading a
meta tensor's value on the host raises too. Each kind of site is compiled on the CPU and on meta:
the same sites are rewritten on both; the ops' real bodies, forward and backward, run on meta with
no host synchronisation (counted), and every node of every per-chunk kernel lives on meta.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpass
from graphpass.ops import chunked_op, devices, vocab_parallel, vocab_parallel_lm_head

T, H, V = 24, 8, 40
# The Python entry points that read a tensor's value on the host (each waits for a device's
# queue). Patched rather than watched from a dispatch mode, which would not see inside the ops.
_HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "cpu", "numpy")


class _SyncCounter:
    """Within `with`: records (method, device) for every host read of a tensor."""

    def __init__(self):
        self.reads = []

    @property
    def syncs(self):
        """The reads that would synchronise: of a tensor that is not on the CPU."""
        return [(name, device) for name, device in self.reads if device != "cpu"]

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
        for name, method in self._saved.items():
            def watched(t, *args, _name=name, _method=method, **kwargs):
                self.reads.append((_name, t.device.type))
                return _method(t, *args, **kwargs)
            setattr(torch.Tensor, name, watched)
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)


# ---- the losses: one per kind of site -----------------------------------------------------------
def logprob_mean(logits, tokens):
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -logp.mean()


def ppo_with_entropy(logits, tokens, adv, temperature=0.7):
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return (-(adv * logp) - 0.01 * entropy).mean()


def ppo_per_token(logits, tokens, adv):
    """The loss per token: no sum the op could take in (recomputing backward)."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -(adv * logp)


def head_ppo(hidden, weight, tokens, adv):
    return ppo_with_entropy(F.linear(hidden, weight), tokens, adv)


def buffer_filled(logits, tokens):
    """OpenRLHF's chunked fill of a preallocated buffer, the functional `copy` capture decomposes."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], 8):
        rows = slice(start, start + 8)
        out[rows] = torch.log_softmax(logits[rows].float(), -1).gather(-1, tokens[rows, None]).squeeze(-1)
    return -out.mean()


def _inputs(kind, device, dtype):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (T,), generator=g).to(device)
    adv = torch.randn(T, generator=g).to(device)
    if kind == "head":
        hidden = torch.randn(T, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
        weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(device=device, dtype=dtype).requires_grad_()
        return [hidden, weight, tokens, adv]
    logits = torch.randn(T, V, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return [logits, tokens] + ([adv] if kind == "adv" else [])


CASES = {  # name: (loss, inputs kind, options)
    "logits": (logprob_mean, "logits", {}),
    "logits, entropy kept": (ppo_with_entropy, "adv", {}),
    "logits, per-token loss": (ppo_per_token, "adv", {}),
    "lm_head, gradients in forward": (head_ppo, "head", {}),
    "lm_head, recomputed": (head_ppo, "head", {"gradients_in_forward": False}),
    "buffer-fill loop": (buffer_filled, "logits", {}),
}


def _compile(name, device, dtype, inner):
    """Compile and run forward and backward: the graph's record."""
    fn, kind, options = CASES[name]
    torch.compiler.reset()  # Dynamo reuses a CPU graph for meta inputs: compile afresh for each device
    backend = graphpass.Backend(inner=inner, strict=True, **options)
    out = torch.compile(fn, backend=backend)(*_inputs(kind, device, dtype))
    out.sum().backward()
    return backend.records[0]


def _meta_like(value):
    if isinstance(value, torch.fx.Node):
        val = value.meta["val"]
        return torch.empty(val.shape, dtype=val.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return [_meta_like(v) for v in value]
    return value


def _run_ops_on_meta(record):
    """Run the real bodies of the graph's chunked ops on meta tensors, forward and backward, and
    count host syncs: (syncs, programs). On meta tensors torch dispatches a custom op to its fake
    kernel, so a compiled graph alone never runs them."""
    counter, programs = _SyncCounter(), []
    ops = (torch.ops.graphpass.rowwise_chunked.default, torch.ops.graphpass.rowwise_chunked_with_gradients.default)
    for node in record.graph_module.graph.find_nodes(op="call_function", target=ops[0]) + \
            record.graph_module.graph.find_nodes(op="call_function", target=ops[1]):
        key, tensors, out_sizes, *rest = _meta_like(node.args)
        program = chunked_op.program(key)
        programs.append(program)
        with counter:
            if node.target is ops[1]:
                program.forward_with_gradients(tensors, out_sizes, *rest)
                continue
            results = program.forward(tensors, out_sizes)
            outs, saved = results[:len(program.outputs)], results[len(program.outputs):]
            grads = [torch.ones_like(o) if spec.keeps_grad else None for o, spec in zip(outs, program.outputs)]
            program.backward(tensors, saved, [t.is_floating_point() for t in tensors], grads)
    return counter.syncs, programs


def _kernel_graphs(program):
    """Every per-chunk kernel graph the program ran: its forward and each gradient kernel."""
    yield "forward", program.split.forward
    for kind, active, wanted in program._gradient_kernels:
        yield kind, getattr(program.split, kind)(active, wanted)


def _devices_named(graph_module):
    """(node, device) for every tensor value and every `device=` argument of the graph."""
    for node in graph_module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            yield node, val.device
        if "device" in node.kwargs and node.kwargs["device"] is not None:
            yield node, torch.device(node.kwargs["device"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_site_kind_runs_on_the_accelerator_path(name, dtype):
    cpu = _compile(name, "cpu", dtype, "eager")
    meta = _compile(name, "meta", dtype, "eager")
    assert cpu.sites, f"{name}: nothing rewritten on the CPU"
    assert [(s.lm_head, s.gradients_in_forward) for s in meta.sites] == \
        [(s.lm_head, s.gradients_in_forward) for s in cpu.sites]
    syncs, programs = _run_ops_on_meta(meta)
    assert syncs == [], syncs
    assert programs and all(p.device.type == "meta" for p in programs)
    for program in programs:
        for kind, graph_module in _kernel_graphs(program):
            wrong = [(n.name, str(d)) for n, d in _devices_named(graph_module) if d.type != "meta"]
            assert not wrong, f"{name}: {kind} kernel names another device: {wrong}"


def test_the_sync_counter_sees_the_cpus_token_check():
    """The counter is not blind: on the CPU the token-id check reads one value on the host."""
    fn, kind, _ = CASES["logits"]
    compiled = torch.compile(fn, backend=graphpass.Backend(inner="eager", strict=True))
    compiled(*_inputs(kind, "cpu", torch.float32))
    with _SyncCounter() as counter:
        compiled(*_inputs(kind, "cpu", torch.float32))
    assert ("__bool__", "cpu") in counter.reads


def test_aot_eager_on_meta():
    record = _compile("lm_head, gradients in forward", "meta", torch.float32, "aot_eager")
    assert record.sites and record.sites[0].lm_head


def test_a_cpu_kernel_is_not_reused_on_another_device():
    """One program per device: the same loss compiled on the CPU, then on meta, traces again."""
    cpu = _compile("logits", "cpu", torch.float32, "eager")
    meta = _compile("logits", "meta", torch.float32, "eager")
    assert {s.program_key for s in cpu.sites}.isdisjoint(s.program_key for s in meta.sites)


@pytest.mark.parametrize("head", [False, True], ids=["logits", "lm_head"])
def test_vocab_parallel_op_has_no_host_sync_on_the_accelerator_path(head):
    """The op's real forward and backward bodies (on meta, the op itself would run its fake)."""
    tokens = torch.randint(0, V, (T,)).to("meta")
    grad = torch.ones(T, device="meta")
    with _SyncCounter() as counter:
        if head:
            hidden = torch.empty(T, H, device="meta", dtype=torch.bfloat16)
            weight = torch.empty(V, H, device="meta", dtype=torch.bfloat16)
            logits = vocab_parallel_lm_head.HeadLogits(hidden, weight, None)
            sink = vocab_parallel_lm_head.HeadGradients(logits, hidden.shape, True, True, False)
        else:
            logits = vocab_parallel.ShardLogits(torch.empty(T, V, device="meta"))
            sink = lambda sl, chunk_grad: None  # noqa: E731
        args = vocab_parallel.VocabParallelArgs("", 0.7, None, 8, "eager", with_entropy=True)
        logprob, entropy, lse, _ = vocab_parallel.forward_statistics(logits, tokens, None, args)
        gradients = vocab_parallel.RowGradients(logits, tokens, None, lse, None, entropy, grad, grad, args)
        vocab_parallel.backward_rows(logits, gradients, sink)
    assert logprob.device.type == "meta" and counter.syncs == []
    if head:
        assert [g.device.type for g in sink.results()[:2]] == ["meta", "meta"]


def test_device_checks_raise_on_the_cpu_and_assert_on_the_device():
    with pytest.raises(IndexError, match="token id 7"):
        devices.check(torch.tensor(False), lambda: IndexError("token id 7"), "a token id")
    devices.check(torch.tensor(True), lambda: IndexError("never"), "never")
    devices.check(torch.tensor(False, device="meta"), lambda: IndexError("never"), "a token id")  # no host read
    assert devices.known_zero(None) and devices.known_zero(torch.zeros(3))
    assert not devices.known_zero(torch.ones(3)) and not devices.known_zero(torch.zeros(3, device="meta"))


@pytest.mark.parametrize("accumulate", [False, True])
def test_mm_into_accumulates_bf16_in_fp32(accumulate):
    g = torch.Generator().manual_seed(2)
    left = torch.randn(16, 32, generator=g).bfloat16()
    right = torch.randn(32, 8, generator=g).bfloat16()
    acc = torch.randn(16, 8, generator=g)
    expected = (acc if accumulate else 0) + left.double() @ right.double()
    devices.mm_into(acc, left, right, accumulate=accumulate)
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), expected, atol=1e-5, rtol=1e-5)
    meta_acc = torch.empty(16, 8, device="meta")
    devices.mm_into(meta_acc, left.to("meta"), right.to("meta"), accumulate=accumulate)  # bf16 operands, fp32 out


def test_the_ops_are_not_captured_by_cuda_graphs():
    for op in (torch.ops.graphpass.rowwise_chunked, torch.ops.graphpass.rowwise_chunked_backward,
               torch.ops.graphpass.rowwise_chunked_with_gradients, torch.ops.graphpass.scale_gradients_,
               torch.ops.graphpass.vocab_parallel_logprob_entropy,
               torch.ops.graphpass.vocab_parallel_logprob_entropy_backward,
               torch.ops.graphpass.vocab_parallel_lm_head_logprob_entropy,
               torch.ops.graphpass.vocab_parallel_lm_head_logprob_entropy_backward):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_autocast_is_as_accurate_as_eager(inner):
    """Training runs the lm_head under autocast: its bf16 matmul is captured as such, and the loss
    and every gradient are as close to float64 as eager's under the same autocast."""
    tensors = _inputs("head", "cpu", torch.float32)
    copies = [[t.detach().clone().requires_grad_(t.requires_grad) for t in tensors] for _ in range(2)]
    exact = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in tensors]
    backend = graphpass.Backend(inner=inner)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(head_ppo, backend=backend)(*copies[0])
        ref = head_ppo(*copies[1])
    exact_loss = head_ppo(*exact)
    for loss in (out, ref, exact_loss):
        loss.backward()
    assert backend.records[0].sites and backend.records[0].sites[0].dtype == torch.bfloat16

    def error(a, b):
        return float((a.double() - b).abs().max() / b.abs().max())

    assert error(out, exact_loss) <= 2 * error(ref, exact_loss) + 1e-6
    for mine, eagers, truth in zip(copies[0][:2], copies[1][:2], exact[:2]):
        assert error(mine.grad, truth.grad) <= 2 * error(eagers.grad, truth.grad) + 1e-6, \
            (error(mine.grad, truth.grad), error(eagers.grad, truth.grad))


def test_cp_ops_have_no_host_sync_on_the_accelerator_path():
    """The CP ops' real bodies (shard, shifted targets, unshard, their backward) on meta tensors."""
    from graphpass.ops import cp_shards as cp_ops

    x = torch.empty(T, V, device="meta")
    tokens = torch.randint(0, V, (T,)).to("meta")
    local_rows = torch.arange(T // 2).to("meta")
    with _SyncCounter() as counter:
        local = cp_ops._take_rows(x, local_rows)
        targets = cp_ops._take_rows(tokens, local_rows, -100)
        full = cp_ops._gather_rows(local, "").index_select(0, local_rows)
        back = cp_ops._put_rows(local, local_rows, T)
    assert counter.syncs == [] and {t.device.type for t in (local, targets, full, back)} == {"meta"}


def test_logits_chunks_on_an_accelerator_take_an_eighth_of_the_floor():
    """Each chunk costs the host a call, which a GPU's chunk of a 64th of the floor did not cover
    (`chunk_sizes.ACCELERATOR_LOGITS_SHARE`): at the PPO anchor's bf16 [32768, 151936] the CPU's
    chunks are 256 rows (a 64th of the floor in fp32 rows), an accelerator's 2048 (an eighth)."""
    rows, vocab = 32768, 151936
    cpu, meta = (chunked_op.program(_compile("logits", device, torch.bfloat16, "eager").sites[0].program_key)
                 for device in ("cpu", "meta"))
    assert cpu.rows_per_chunk(rows, vocab, 2) == 256
    assert meta.rows_per_chunk(rows, vocab, 2) == 2048
