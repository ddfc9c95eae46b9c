"""The speed-of-light measurement: the two passes over logits [T, V] that no implementation of a
log-prob/entropy loss can avoid (`forward_pass`: one read yielding each row's log-sum-exp;
`backward_pass`: one read of the logits, one write of their gradient), compiled and timed on given
logits (`Passes`; on a CPU the forward also over row blocks that fit in the last-level cache,
`cache_bytes`). The suite's worker times a SoL step beside each of a method's steps
(`bench.harness.measure`); `python -m bench.sol` times them alone over a grid.
"""

from __future__ import annotations

from pathlib import Path

from bench.harness.meters import timed


def forward_pass(logits, temperature: float):
    """Each row's log-sum-exp of `logits / temperature`, in fp32: one read of the logits."""
    return (logits.float() / temperature).logsumexp(-1)


def backward_pass(logits, lse, target, grad_logprob, temperature: float):
    """The log-prob's gradient `(onehot - softmax) * g / temperature`, in the logits' dtype: one read
    of the logits, one write of the gradient."""
    x = logits.float() / temperature
    onehot = (target[:, None] == _columns(x)).float()
    return ((onehot - (x - lse[:, None]).exp()) * (grad_logprob / temperature)[:, None]).to(logits.dtype)


def _columns(x):
    import torch

    return torch.arange(x.shape[-1], device=x.device)[None, :]


class Passes:
    """The two passes over given logits `[T, V]`, compiled; `step()` times one of each."""

    TEMPERATURE = 0.7

    def __init__(self, logits, seed: int = 0):
        import torch

        g = torch.Generator(device="cpu").manual_seed(seed)
        self.logits = logits
        self.device = logits.device
        self.target = torch.randint(0, logits.shape[-1], (logits.shape[0],), generator=g).to(self.device)
        self.grad_logprob = torch.randn(logits.shape[0], generator=g).to(self.device)
        self.forward = torch.compile(forward_pass, dynamic=False)
        self.backward = torch.compile(backward_pass, dynamic=False)
        # On a CPU, the forward's two reads of a row (its max, then its sum of exponentials) cost
        # one from memory when the rows come in blocks that stay in the last-level cache: the
        # limit is the faster of the whole tensor and such blocks.
        rows = max(1, cache_bytes() // 4 // (logits.shape[-1] * 4))
        self.blocks = [logits] if self.device.type != "cpu" or rows >= logits.shape[0] else list(logits.split(rows))
        with torch.no_grad():
            self.lse = self.forward(logits, self.TEMPERATURE)
            self._forward_blocks()  # compiles the blocks' shapes

    def backward_max_abs_error(self, rows: int = 64) -> float:
        """The compiled backward pass against autograd's gradient, on the first rows."""
        import torch

        t, rows = self.TEMPERATURE, min(rows, self.logits.shape[0])
        with torch.no_grad():
            grad = self.backward(self.logits, self.lse, self.target, self.grad_logprob, t)[:rows]
        expected = torch.func.grad(lambda x: (torch.log_softmax(x.float() / t, -1).gather(
            1, self.target[:rows, None])[:, 0] * self.grad_logprob[:rows]).sum())(self.logits[:rows])
        return float((grad.float() - expected.float()).abs().max())

    def step(self) -> tuple[float, float]:
        """Seconds of one forward pass and one backward pass (its gradient dropped at once)."""
        import torch

        t = self.TEMPERATURE
        with torch.no_grad():
            forward_s = timed(lambda: self.forward(self.logits, t), str(self.device))
            if len(self.blocks) > 1:
                forward_s = min(forward_s, timed(self._forward_blocks, str(self.device)))
            backward_s = timed(lambda: self.backward(self.logits, self.lse, self.target, self.grad_logprob, t),
                                str(self.device))
        return forward_s, backward_s


    def _forward_blocks(self):
        return [self.forward(block, self.TEMPERATURE) for block in self.blocks]


def cache_bytes() -> int:
    """This CPU's last-level cache (32 MiB where sysfs does not say)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return 32 * 2**20
