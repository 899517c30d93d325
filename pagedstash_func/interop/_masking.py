"""transformers' mask code told what a `from_hf_model` loss knows while it runs in this
thread: that its sequences are not packed, and that a call without a padding mask is plain
causal attention (so a captured step keeps sdpa's causal kernels and reads nothing on the
host). Installed once; outside such a loss transformers' own functions answer.
"""

from __future__ import annotations

import threading

__all__ = ["ACTIVE", "causal_without_padding", "unpacked_positions"]


class _Active(threading.local):
    """What the patched sparse blocks read while `loss_fn` runs: the params and the routing
    mask of the current call (``None`` outside one)."""

    value = None


ACTIVE = _Active()


def _patch_masking(name: str, marker: str, wrap) -> None:
    """Replace transformers' ``masking_utils.<name>`` by ``wrap(original)`` once (``marker``
    set on the replacement; its ``__wrapped__`` is the original)."""
    try:
        from transformers import masking_utils
    except ImportError:                   # pragma: no cover - transformers is present here
        return
    original = getattr(masking_utils, name, None)
    if original is None or getattr(original, marker, False):
        return
    patched = wrap(original)
    setattr(patched, marker, True)
    patched.__wrapped__ = original
    setattr(masking_utils, name, patched)


def unpacked_positions() -> None:
    """Tell transformers' mask code, while a from_hf_model loss runs in this thread, that the
    sequences are not packed. Without an attention mask it looks for packed sequences in the
    position ids it made itself (an ``arange``, since a batch here cannot carry its own):
    eagerly by reading the device on the host (a sync in every forward), and under CUDA-graph
    capture, where it cannot read, by building a full mask, which takes sdpa off its causal
    flash kernel. Installed once; outside such a loss transformers' own function answers."""
    def wrap(original):
        def find_packed_sequence_indices(position_ids):
            if ACTIVE.value is not None:
                return None
            return original(position_ids)
        return find_packed_sequence_indices
    _patch_masking("find_packed_sequence_indices", "_psf_unpacked", wrap)


def causal_without_padding() -> None:
    """Tell transformers' sdpa mask code, while a from_hf_model loss runs in this thread, that
    a call without a padding mask is plain causal attention. transformers before 5.24 (5.17,
    say) builds a full ``[B, 1, S, S]`` mask whenever a CUDA stream is capturing, even with no
    padding mask to read, which takes sdpa off its causal kernels: in a captured whole-model
    step the attention backward then runs cuDNN's masked engine (about 3.5x the time). With no
    padding mask and as many queries as keys (no cache here), ``is_causal`` is exact, captured
    or not; every other call gets transformers' own answer (the replacement's
    ``__wrapped__``). Installed once."""
    def wrap(original):
        def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, *args, **kwargs):
            local = kwargs.get("local_attention_size", args[2] if len(args) > 2 else None)
            if ACTIVE.value is not None and padding_mask is None and q_length == kv_length \
                    and (local is None or kv_length < local):
                return True
            return _ignore_causal_mask_sdpa.__wrapped__(padding_mask, q_length, kv_length,
                                                        *args, **kwargs)
        return _ignore_causal_mask_sdpa
    _patch_masking("_ignore_causal_mask_sdpa", "_psf_causal", wrap)
