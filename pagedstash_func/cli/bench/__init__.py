"""Benchmarks behind ``python -m pagedstash_func bench``: stash, moe, peer, memory, router,
adaptive, ep, train, lm-loss and the anchor loader. Each prints ratios against a baseline
measured in the same process."""
