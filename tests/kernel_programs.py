"""Row-local programs as graphpass extracts them, for the generated kernels' tests and benchmark.

Each is a module computing in `compute` (fp32 for the program, float64 for the reference), and a
function making its arguments: logits `[T, V]` first, then per-row or scalar inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Program(torch.nn.Module):
    def __init__(self, compute=torch.float32):
        super().__init__()
        self.compute = compute


class LogProb(Program):
    """The picked token's log-prob (cross-entropy's negative)."""

    def forward(self, logits, index):
        return (torch.log_softmax(logits.to(self.compute), -1).gather(-1, index),)


class LogProbEntropy(Program):
    """log-prob and entropy at a temperature: a 0-d tensor, or one per token `[T, 1]`."""

    def forward(self, logits, index, temperature):
        logp = torch.log_softmax(logits.to(self.compute) / temperature, -1)
        return logp.gather(-1, index), -(logp.exp() * logp).sum(-1, keepdim=True)


class SoftCapped(Program):
    """Gemma-2's soft-capping `cap * tanh(x / cap)` before the log-prob and entropy."""

    def forward(self, logits, index):
        x = logits.to(self.compute)
        x = 30.0 * torch.tanh(x / 30.0)
        logp = torch.log_softmax(x, -1)
        return logp.gather(-1, index), -(logp.exp() * logp).sum(-1, keepdim=True)


class Masked(Program):
    """A vocabulary mask `[1, V]` (padding columns) and a per-token mask `[T, 1]` on the log-prob."""

    def forward(self, logits, index, allowed, token_mask):
        x = logits.to(self.compute).masked_fill(~allowed, -1e30)
        logp = torch.log_softmax(x, -1)
        return logp.gather(-1, index) * token_mask, -(logp.exp() * logp).sum(-1, keepdim=True)


class RoundedTemperature(Program):
    """bf16 logits divided by the temperature in bf16 (eager's rounding), then upcast."""

    def forward(self, logits, index):
        logp = torch.log_softmax((logits / 0.7).to(self.compute), -1)
        return (logp.gather(-1, index),)


class TeacherKL(Program):
    """KL(teacher || student) per token, the teacher's logits gradient-free."""

    def forward(self, logits, teacher):
        logp = torch.log_softmax(logits.to(self.compute), -1)
        logq = torch.log_softmax(teacher.to(self.compute), -1)
        return ((logq.exp() * (logq - logp)).sum(-1, keepdim=True),)


class LabelSmoothing(Program):
    """Cross-entropy with label smoothing 0.1, per token."""

    def forward(self, logits, index):
        logp = torch.log_softmax(logits.to(self.compute), -1)
        return (-(0.9 * logp.gather(-1, index) + 0.1 * logp.mean(-1, keepdim=True)),)


def arguments(name: str, rows: int, vocab: int, dtype: torch.dtype, generator: torch.Generator) -> list:
    """The arguments of program `name` (a class above) at `[rows, vocab]` logits of `dtype`."""
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    index = torch.randint(0, vocab, (rows, 1), generator=generator)
    if name == "LogProbEntropy":
        return [logits, index, torch.tensor(0.7)]
    if name == "LogProbEntropyPerToken":
        return [logits, index, torch.rand(rows, 1, generator=generator) + 0.5]
    if name == "Masked":
        allowed = torch.ones(1, vocab, dtype=torch.bool)
        allowed[0, vocab - vocab // 7:] = False
        index = torch.randint(0, vocab - vocab // 7, (rows, 1), generator=generator)
        token_mask = (torch.rand(rows, 1, generator=generator) > 0.3).float()
        return [logits, index, allowed, token_mask]
    if name == "TeacherKL":
        return [logits, (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)]
    return [logits, index]


def program_class(name: str) -> type:
    return LogProbEntropy if name == "LogProbEntropyPerToken" else globals()[name]


NAMES = ["LogProb", "LogProbEntropy", "LogProbEntropyPerToken", "SoftCapped", "Masked", "RoundedTemperature",
         "TeacherKL", "LabelSmoothing"]
