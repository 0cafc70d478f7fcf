"""The vision code selection in cache-sized blocks: the codes of one full score matrix's argmax."""

from __future__ import annotations

import pytest
import torch

from apertus_plugins.encoders import select_codes_by_dot_product


def _full_argmax(latents: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    b, d, h, w = latents.shape
    return torch.mm(latents.flatten(2).transpose(1, 2).reshape(-1, d), book.t()).argmax(1).view(b, h, w)


@pytest.mark.parametrize("shape", [(1, 16, 16), (1, 3, 5), (2, 9, 30), (1, 40, 41)])
@pytest.mark.parametrize("budget", [128 * 2**20, 300_000])
def test_blocks_select_the_full_argmax(shape, budget):
    g = torch.Generator().manual_seed(sum(shape) + budget)
    b, h, w = shape
    book = torch.randn(5_000, 32, generator=g)
    latents = torch.randn(b, 32, h, w, generator=g)
    assert torch.equal(select_codes_by_dot_product(latents, book, budget), _full_argmax(latents, book))


def test_equal_scores_keep_the_first_index():
    """Duplicated codebook rows across block boundaries: the first copy wins, as argmax picks it."""
    g = torch.Generator().manual_seed(1)
    book = torch.randn(9_000, 16, generator=g)
    latents = torch.randn(1, 16, 4, 4, generator=g)
    best = _full_argmax(latents, book)
    dup = book.clone()
    for i in best.flatten().tolist():
        dup[8_999 - (i % 7)] = book[i]  # a later copy of each winner, in another block
    got = select_codes_by_dot_product(latents, dup, 64 * 1024)
    assert torch.equal(got, _full_argmax(latents, dup))
    assert torch.equal(got, best)
