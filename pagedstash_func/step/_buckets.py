"""`pad_rows`: a batch of ``T`` token rows padded to the smallest of a few fixed sizes, so
that batches whose token count varies take a few shapes (one state each)."""

from __future__ import annotations

import math

import torch

__all__ = ["pad_rows"]


def pad_rows(batch: dict, buckets, fill: dict, *, dim: int = 0, pad_key: str = "pad") -> dict:
    """``batch`` with its ``T`` rows padded to the smallest of ``buckets`` that holds ``T``.

    The rows are padded along ``dim``; `pad_to_bucket` does this for transformers' LM batches.
    The loss routes the rows its mask marks to padding (id ``-1``: no capacity, no pages) and
    leaves them out of its reduction; its loss and gradients are then the unpadded batch's.

    Args:
        batch: a dict of tensors.
        buckets: the row counts a batch may take (positive ints).
        fill: ``{key: value}``: the tensors to pad, each with ``T`` rows along ``dim``, and
            what their new rows hold (e.g. ``{"x": 0.0, "ids": -1}``).
        dim: the dim the rows lie along, in every tensor of ``fill``.
        pad_key: ``batch[pad_key]``, a bool ``[bucket]`` tensor on the rows' device, is True on
            the padding rows: a given ``[T]`` mask extended with True, else a new one (False
            on the given rows).

    Returns:
        A new dict: the padded tensors, the mask, and every other entry as it was. Every
            tensor with ``T`` rows along ``dim`` must be named in ``fill`` (one left out would
            stay ``T`` rows long beside the padded ones): take one that must not be padded out
            of the batch first.

    Raises:
        ValueError: no bucket holds ``T``, entries do not fit (``fill`` naming keys the batch
            lacks or the mask, tensors of different row counts, a ``T``-row tensor left out of
            ``fill``, a mask that is not bool ``[T]`` on the rows' device), or a fill value the
            tensor's dtype cannot hold.

    Example::

        padded = psf.pad_rows({"x": x}, buckets=(512, 1024), fill={"x": 0.0})
        state = states.get(len(padded["pad"])) or step.init(params, padded)
    """
    rows, values = _rows_to_pad(batch, fill, dim, pad_key)
    size = _bucket_for(rows, buckets)
    out = dict(batch)
    for key, value in values.items():
        t = batch[key]
        shape = list(t.shape)
        shape[dim] = size - rows
        out[key] = torch.cat([t, t.new_full(shape, value)], dim=dim)
    given = _given_mask(batch, pad_key, rows, batch[next(iter(fill))].device)
    out[pad_key] = torch.cat([given, given.new_ones(size - rows)])
    return out


def _rows_to_pad(batch, fill, dim: int, pad_key: str) -> tuple[int, dict]:
    """``(T, {key: fill value})``: the rows the tensors of ``fill`` hold along ``dim``, once
    the batch, ``fill`` and every ``T``-row entry are checked (`pad_rows`' Raises)."""
    if not isinstance(batch, dict):
        raise ValueError(f"pad_rows pads a dict of tensors, got {type(batch).__name__}")
    if not isinstance(fill, dict) or not fill:
        raise ValueError("pad_rows needs fill={key: value} naming the tensors to pad and what "
                         "their new rows hold, e.g. {'x': 0.0, 'ids': -1}")
    missing = [k for k in fill if k not in batch]
    if missing:
        raise ValueError(f"fill names {missing}, which the batch does not hold "
                         f"(keys: {list(batch)})")
    if pad_key in fill:
        raise ValueError(f"{pad_key!r} is the padding mask pad_rows extends itself: leave it "
                         f"out of fill")
    sizes, values = [], {}
    for key in fill:
        t = batch[key]
        if not isinstance(t, torch.Tensor) or not -t.ndim <= dim < t.ndim:
            raise ValueError(f"batch[{key!r}] must be a tensor with a dim {dim}; got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        sizes.append(t.shape[dim])
        values[key] = _check_fill(key, t, fill[key])
    if len(set(sizes)) > 1:
        raise ValueError(f"the tensors in fill hold different row counts along dim {dim}: "
                         f"{dict(zip(fill, sizes))}")
    rows = sizes[0]
    left = [k for k, t in batch.items() if k not in fill and k != pad_key
            and isinstance(t, torch.Tensor) and -t.ndim <= dim < t.ndim
            and t.shape[dim] == rows]
    if left:
        raise ValueError(f"batch entries {left} also hold {rows} rows along dim {dim} but are "
                         f"not in fill, so they would stay {rows} rows long beside padded "
                         f"ones: name them in fill too (with what their new rows hold), or "
                         f"take them out of the batch before padding")
    return rows, values


def _bucket_for(rows: int, buckets) -> int:
    """The smallest of ``buckets`` that holds ``rows`` (checked: positive whole counts)."""
    try:
        given_sizes = list(buckets)
        fits = sorted(int(b) for b in given_sizes)
    except (TypeError, ValueError, OverflowError):
        given_sizes = fits = []
    if not fits or any(b < 1 for b in fits) or any(
            isinstance(b, bool) or int(b) != b for b in given_sizes):
        raise ValueError(f"buckets must be positive row counts, e.g. (512, 1024); got "
                         f"{buckets!r}")
    size = next((b for b in fits if b >= rows), None)
    if size is None:
        raise ValueError(f"a batch of {rows} rows is larger than the largest bucket "
                         f"({fits[-1]}): add a bucket, or split the batch")
    return size


def _given_mask(batch, pad_key: str, rows: int, device) -> torch.Tensor:
    """The batch's bool ``[T]`` padding mask on ``device``, or a new all-False one."""
    given = batch.get(pad_key)
    if given is None:
        return torch.zeros(rows, dtype=torch.bool, device=device)
    if not isinstance(given, torch.Tensor) or given.dtype != torch.bool or \
            tuple(given.shape) != (rows,) or given.device != device:
        raise ValueError(f"batch[{pad_key!r}] must be a bool [{rows}] padding mask (True on "
                         f"padding rows) on the rows' device ({device}); got "
                         f"{getattr(given, 'dtype', type(given).__name__)} "
                         f"{tuple(getattr(given, 'shape', ()))}"
                         f"{' on ' + str(given.device) if isinstance(given, torch.Tensor) else ''}")
    return given


def _check_fill(key, t: torch.Tensor, value):
    """``value`` as a Python number, which must be one ``t``'s dtype holds as it is (a fill
    of ``-1`` in a ``uint8`` tensor would wrap to 255, ``0.5`` in an integer one truncate to
    0, ``1e39`` in a float32 one become inf)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"fill[{key!r}] must be one number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if not isinstance(value, (bool, int, float, complex)) and hasattr(value, "item"):
        value = value.item()                                          # a numpy scalar
    if not isinstance(value, (bool, int, float, complex)):
        raise ValueError(f"fill[{key!r}] must be a number, got {type(value).__name__}")
    if t.dtype.is_complex:
        ok = True
    elif isinstance(value, complex):
        ok = False
    elif t.dtype == torch.bool:
        ok = value in (0, 1)
    elif t.dtype.is_floating_point:
        try:
            ok = not math.isfinite(value) or abs(value) <= torch.finfo(t.dtype).max
        except OverflowError:                # an int too large for any float
            ok = False
    else:
        info = torch.iinfo(t.dtype)
        ok = (isinstance(value, int) or (math.isfinite(value) and value.is_integer())) \
            and info.min <= value <= info.max
    if not ok:
        raise ValueError(f"fill[{key!r}] = {value!r} does not fit batch[{key!r}]'s dtype "
                         f"{str(t.dtype).removeprefix('torch.')}: its padding rows would hold "
                         f"another value. Give a value that dtype holds")
    return value
