"""`graphpass.explain` and `graphpass inspect` decide as the backend does (`pipeline.decide`: the
rewrite, its memory veto, lint): on every idiom of the grid and every case of the library corpus,
each graph runs rewritten or unchanged alike, with the same sites."""

from __future__ import annotations

import pytest
import torch

import graphpass
from graphpass import _torch_api, inspection
from graphpass.config import Config
from idioms import IDIOMS  # tests/ is on sys.path
from test_idioms import make_inputs, site_kind
from corpus import CASES
from corpus._harness import DTYPES

CONFIG = Config(chunk_size=4, inner="aot_eager")


def _decisions(records) -> list:
    """Per graph: whether it runs unchanged, and its sites (kind, lm_head fused)."""
    return [(r.fallback_reason is not None, sorted((site_kind(s), s.lm_head) for s in r.sites)) for r in records]


def _agree(fn, args, kwargs):
    torch.compiler.reset()
    backend = graphpass.Backend(CONFIG)
    torch.compile(fn, backend=backend)(*args, **kwargs)
    torch.compiler.reset()
    fake_mode = _torch_api.new_fake_mode(allow_real_tensors=True)
    fakes = inspection.fakeify(args, fake_mode)
    fake_kwargs = dict(zip(kwargs, inspection.fakeify(kwargs.values(), fake_mode)))
    explained = inspection.rewrite_results(fn, fakes, fake_kwargs, CONFIG)
    torch.compiler.reset()
    assert _decisions(r.record for r in explained) == _decisions(backend.records)
    assert [r.record.warnings for r in explained] == [r.warnings for r in backend.records]


@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda i: i.name)
def test_explain_decides_every_idiom_as_the_backend(idiom):
    logits, tokens, extra = make_inputs(idiom.layouts[0], 13, torch.float32)
    _agree(idiom.fn, (logits, tokens), extra)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_explain_decides_every_corpus_case_as_the_backend(case):
    _agree(case.fn, (), case.make_inputs(DTYPES[case.dtypes[0]]))
