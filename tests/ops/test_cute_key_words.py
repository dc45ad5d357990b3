"""ops.cute_flash.key_words: the packed key mask the CuTe kernels read (CPU: no GPU or DSL needed)."""

from __future__ import annotations

import pytest
import torch

from fa_backend.ops.cute_flash import key_words


@pytest.mark.parametrize("shape", [(3, 1, 1, 70), (3, 4, 1, 70), (1, 1, 1, 70), (70,), (3, 4, 5, 70)])
def test_words_hold_the_mask_bit_for_bit(shape):
    mask = torch.rand(shape) > 0.4
    if len(shape) == 4 and shape[2] > 1:  # a key mask expanded over the queries (stride 0)
        mask = mask[:, :, :1].expand(shape)
    words = key_words(mask, 3, 4, 70)
    assert words.shape == (3, 4, 4) and words.dtype == torch.int32 and words.stride(2) == 1
    bits = (words[..., :3].to(torch.int64)[..., None] >> torch.arange(32)) & 1  # (3, 4, 3, 32)
    full = torch.broadcast_to(mask, (3, 4, 5, 70))[:, :, 0] if mask.dim() == 4 else mask.expand(3, 4, 70)
    assert torch.equal(bits.flatten(-2)[..., :70].bool(), full)
    assert not bits.flatten(-2)[..., 70:].any()  # keys past seqlen_k hidden
    # the last word: 1 + the last attended key, 0 for a row that attends to none
    last = torch.where(full, torch.arange(70), -1).amax(-1) + 1
    assert torch.equal(words[..., 3], last.to(torch.int32))


def test_broadcast_dims_are_not_copied():
    words = key_words(torch.ones(1, 1, 1, 64, dtype=torch.bool), 8, 16, 64)
    assert words.stride()[:2] == (0, 0)


@pytest.mark.parametrize("sk", [1, 31, 32, 33, 64, 100])
def test_bound_covers_every_bit_position(sk):
    """The key bound for each possible last attended key, the sign bit included (key 31 of a word)."""
    for last in range(sk):
        mask = torch.zeros(1, 1, 1, sk, dtype=torch.bool)
        mask[..., last] = True
        mask[..., : last // 2] = True
        assert key_words(mask, 1, 1, sk)[0, 0, -1].item() == last + 1
    assert key_words(torch.zeros(1, 1, 1, sk, dtype=torch.bool), 1, 1, sk)[0, 0, -1].item() == 0
