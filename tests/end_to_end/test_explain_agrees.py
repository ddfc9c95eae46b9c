"""`graphpass.explain` and `graphpass inspect` decide as the backend does (`pipeline.decide`: the
rewrite, its memory veto, lint): on every idiom of the grid each graph runs rewritten or unchanged
alike, with the same sites and warnings. (The library corpus's cases: `test_corpus`, beside the
backend's own run of each.)"""

from __future__ import annotations

import pytest
import torch

import graphpass
from graphpass.config import Config
from helpers import decisions, explained_records
from idioms import IDIOMS  # tests/ is on sys.path
from test_idioms import make_inputs

CONFIG = Config(chunk_size=4, inner="aot_eager")


@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda i: i.name)
def test_explain_decides_every_idiom_as_the_backend(idiom):
    logits, tokens, extra = make_inputs(idiom.layouts[0], 13, torch.float32)
    torch.compiler.reset()
    backend = graphpass.Backend(CONFIG)
    torch.compile(idiom.fn, backend=backend)(logits, tokens, **extra)
    assert decisions(explained_records(idiom.fn, (logits, tokens), extra, CONFIG)) == decisions(backend.records)
