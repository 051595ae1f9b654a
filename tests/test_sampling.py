"""The native engine's sampler (omnirl.rollout.generate): top-k / top-p filters, and the CDF inversion at a
row's uniform that makes a request's sample independent of its batch."""

import torch

from omnirl.rollout.generate import invert_cdf, sample


def test_sampling_filters():
    """top-k / top-p only pick among the allowed tokens, top_k 1 is the argmax, and the draw is the
    inverse CDF of the row's uniform (so a uniform of 0 picks the most probable kept token)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]).repeat(4, 1)
    logp = logits.log_softmax(-1)
    u = torch.linspace(0, 0.999, 200)
    for top_k, top_p, allowed in [
        (2, 1.0, {1, 3}),
        (0, 0.7, {1, 3}),
        (1, 1.0, {1}),
        (0, 1.0, {0, 1, 2, 3, 4}),
    ]:
        tokens = {
            int(sample(logp[:1], torch.tensor([top_p]), torch.tensor([top_k]), x[None]))
            for x in u  # one row per call: the whole range of uniforms
        }
        assert tokens == allowed, (top_k, top_p, tokens)
    # per-row settings in one call
    rows = sample(logp, torch.tensor([1.0, 0.5, 1.0, 1.0]), torch.tensor([1, 0, 0, 3]), torch.zeros(4))
    assert rows.tolist() == [1, 1, 1, 1]


def test_two_level_cdf_inversion_is_the_one_level_one():
    """`invert_cdf` (block sums, then the chosen block's own CDF) returns what inverting the whole CDF
    returns (in float64, where rounding cannot move a boundary), for vocabularies that do and do not fill
    their last block; and never a token of probability 0, at uniforms 0 and just below 1 included."""
    gen = torch.Generator().manual_seed(0)
    for vocab, block in [(5000, 64), (4096, 1024), (13, 4), (7, 16)]:
        probs = torch.randn(16, vocab, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
        probs[:, torch.rand(vocab, generator=gen) < 0.3] = 0.0  # banned / filtered ids
        probs[:, -1] = 0.0
        uniforms = torch.rand(16, generator=gen, dtype=torch.float64)
        uniforms[0], uniforms[1] = 0.0, 1 - 2**-53
        cdf = probs.cumsum(-1)
        reference = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
        got = invert_cdf(probs, uniforms, block)
        assert torch.equal(got[2:], reference[2:]), (vocab, block)
        assert got[0] == reference[0]  # uniform 0: the first token of mass > 0
        assert (probs.gather(1, got[:, None]) > 0).all(), (vocab, block)
    # float32 at the real vocabulary size: rounding may move a boundary by a rounding error's worth of
    # mass, never onto a zero.
    probs = torch.randn(64, 151936, generator=gen).mul(4).softmax(-1)
    probs[:, 151646:] = 0.0
    uniforms = torch.rand(64, generator=gen)
    uniforms[-1] = 1 - 2**-24
    got = invert_cdf(probs, uniforms)
    assert (probs.gather(1, got[:, None]) > 0).all()
    cdf = probs.double().cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    upper, lower = (
        cdf.gather(1, got[:, None]).squeeze(1),
        (cdf - probs.double()).gather(1, got[:, None]).squeeze(1),
    )
    assert ((lower - 1e-5 <= target) & (target <= upper + 1e-5)).all()
