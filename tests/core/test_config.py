"""StashConfig: validation names the fix; defaults are DESIGN's; the config is frozen."""

import dataclasses

import pytest

import pagedstash_func as psf


@pytest.mark.parametrize(
    "kw, match",
    [(dict(paged_stash=True), "paged_stash=True needs a capacity_factor"),
     (dict(capacity_factor=0.0), "positive finite"),
     (dict(capacity_factor=-1.0), "positive finite"),
     (dict(capacity_factor=float("inf")), "positive finite"),
     (dict(capacity_factor=float("nan")), "positive finite"),
     (dict(capacity_factor="1.2"), "positive finite"),
     (dict(page_size=0), r"page_size must be an integer in \[1, 4096\]"),
     (dict(page_size=2.5), r"page_size must be an integer in \[1, 4096\]"),
     (dict(page_size=10**6), r"page_size must be an integer in \[1, 4096\]"),
     (dict(capacity_factor=1.0, paged_stash="no"), "paged_stash must be True or False"),
     (dict(cuda_factor=float("nan")), "cuda_factor must be a finite number"),
     (dict(host_factor=float("inf")), "host_factor must be a finite number"),
     (dict(expert_ranks=0), "expert_ranks must be an integer >= 1"),
     (dict(backend="cuda"), "backend must be one of")])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        psf.StashConfig(**kw)


def test_config_defaults():
    c = psf.StashConfig()
    assert (c.capacity_factor, c.paged_stash, c.page_size, c.cuda_factor, c.host_factor,
            c.expert_ranks) == (None, False, 64, 1.10, 0.0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 32
