"""NVSHMEM symmetric memory: the workspace behind `_comm.SymmetricSlots`.

``torch.ops.symm_mem.all_to_all_vdev`` moves rows whose split sizes live on the device: no
host read, and it captures into CUDA graphs. It needs its input, output and split tensors in
symmetric memory (allocated collectively, the same size on every rank), so each (process,
group) owns one `Workspace`: a send and a receive buffer of bytes, the split tensors, and a
one-element tensor for a device barrier. The workspace is not part of any state pytree:
``clone``, ``reset``, save and replay never see it.

Three facts about the op (torch 2.11, measured on two H200s) shape this module:

- It *pulls*: each rank reads its rows out of the peers' send buffers, and returns when its own
  reads are done, not the peers'. A rank that rewrote its send buffer (or let a peer's next
  exchange overwrite its split tensors) right away could hand a slow peer the wrong rows. So
  every exchange ends with a device barrier (a one-element NCCL all-reduce on the stream: no
  host sync, capturable). One send buffer then serves every exchange, in any order, also when
  a CUDA graph replays them.
- It splits each peer's bytes over ``64 / R`` thread blocks (64 blocks once the input view is
  at least 4 MiB) and asserts that they divide evenly. Rows are therefore laid out with a
  stride of a multiple of 64 bytes, buffers hold at least 4 MiB plus a row (so the op's view
  of a whole buffer is at least 4 MiB) and ``R`` must be a power of two; other groups use
  fixed slots.
- Its output past the received rows is whatever an earlier exchange left there: the caller
  knows how many rows arrived (`_comm` computes the shares on every rank) and masks the rest.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from ..core._config import TRANSPORTS
ENV = "PAGEDSTASH_TRANSPORT"          # forces the transport where the config says "auto"
ROW_ALIGN = 64                        # bytes: see the module docstring
MIN_BYTES = 4 << 20                   # views this large get the op's full 64 blocks

_WORKSPACES: dict = {}


def all_to_all_vdev(send, recv, in_splits, out_splits, group_name) -> None:
    """The op itself (one indirection, so that tests can emulate it on gloo)."""
    torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits, group_name)


def unavailable(group) -> str | None:
    """Why the NVSHMEM transport cannot run over ``group``, or ``None`` if it can."""
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)!r}, not 'nccl'"
    ranks = dist.get_world_size(group)
    if ranks < 2 or ranks & (ranks - 1):
        return f"the group has {ranks} ranks; the exchange needs a power of two >= 2"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return "this torch has no torch.distributed._symmetric_memory"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return "this torch has no torch.ops.symm_mem.all_to_all_vdev"
    if not symm_mem.is_nvshmem_available():
        return "NVSHMEM is not installed (pip install nvidia-nvshmem-cu13, or cu12)"
    return None


def available_transports(group) -> tuple:
    """The transports that run over ``group``, the one ``"auto"`` picks first.

    Args:
        group: a process group.

    Returns:
        ``("nvshmem", "fixed")`` where NVSHMEM runs over ``group``, else ``("fixed",)``.
    """
    return ("fixed",) if unavailable(group) is not None else ("nvshmem", "fixed")


def resolve(requested: str, group) -> str:
    """``"fixed"`` or ``"nvshmem"``: the config's choice, else ``$PAGEDSTASH_TRANSPORT``, else
    NVSHMEM where it can run. Forcing NVSHMEM where it cannot is a `ValueError`."""
    source = "StashConfig(transport='nvshmem')"
    if requested == "auto":
        requested = os.environ.get(ENV, "auto") or "auto"
        if requested not in TRANSPORTS:
            raise ValueError(f"${ENV}={requested!r}: expected one of {TRANSPORTS} (or unset it)")
        source = f"${ENV}=nvshmem"
    reason = unavailable(group)
    if requested == "nvshmem" and reason is not None:
        fix = (f"unset ${ENV} (or set it to 'fixed')" if source.startswith("$")
               else "use StashConfig(transport='fixed') or 'auto', which picks it")
        raise ValueError(f"transport 'nvshmem' ({source}) cannot run here: {reason}; {fix}")
    if requested == "auto":
        return "fixed" if reason is not None else "nvshmem"
    return requested


def row_stride(width: int, dtype: torch.dtype) -> int:
    """Elements from one row to the next in the workspace: ``width`` rounded up so that a row
    spans a multiple of `ROW_ALIGN` bytes."""
    return math.ceil(width * dtype.itemsize / ROW_ALIGN) * ROW_ALIGN // dtype.itemsize


def bytes_for(rows: int, width: int, dtype: torch.dtype) -> int:
    """Workspace bytes that one exchange of ``rows`` rows of ``width`` elements needs (at least
    `MIN_BYTES` plus one row, so that the op's view of the whole buffer gets its 64 blocks)."""
    row = row_stride(width, dtype) * dtype.itemsize
    return max(MIN_BYTES + row, rows * row)


def workspace(group) -> Workspace:
    key = _group_name(group), torch.cuda.current_device()
    if key not in _WORKSPACES:
        _WORKSPACES[key] = Workspace(group)
    return _WORKSPACES[key]


def workspace_bytes() -> int:
    """Bytes this process holds in NVSHMEM workspaces.

    They lie outside torch's caching allocator, so ``torch.cuda.memory_allocated`` does not
    count them.

    Returns:
        The bytes, an int (0 when no workspace was made).
    """
    return sum(w.held_bytes() for w in _WORKSPACES.values())


def _group_name(group) -> str:
    return (group or dist.group.WORLD).group_name


class Workspace:
    """Symmetric buffers of one process group on this process's current CUDA device.

    `reserve` grows them (collectively: every rank must reserve the same sizes in the same
    order, which the layers agreed at ``step.init`` guarantee); `send_view` is where a dispatch
    gather writes its rows; `exchange` runs one variable-split all-to-all and the barrier.
    """

    def __init__(self, group, device=None):
        self.group, self.name = group, _group_name(group)
        self.ranks = dist.get_world_size(group)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.nbytes = 0
        self.send = self.recv = None
        self._retired: list = []      # earlier buffers: kept, a captured graph may use them
        self.in_splits = self._symmetric(self.ranks, dtype=torch.int64)
        self.out_splits = self._symmetric(2, self.ranks, dtype=torch.int64)
        self.token = torch.zeros(1, dtype=torch.float32, device=self.device)

    def _symmetric(self, *shape, dtype):
        import torch.distributed._symmetric_memory as symm_mem
        if symm_mem.get_backend(self.device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        t = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        symm_mem.rendezvous(t, self.name)
        return t

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   [self.send, self.recv, self.in_splits, self.out_splits, *self._retired]
                   if t is not None)

    def reserve(self, nbytes: int) -> None:
        """Buffers of at least ``nbytes`` each (a collective call when they grow)."""
        if nbytes <= self.nbytes:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError("the NVSHMEM workspace would have to grow inside a CUDA graph "
                             "capture: run the step once before capturing it (psf.graphed "
                             "does), at the largest shapes first")
        if self.send is not None:
            self._retired += [self.send, self.recv]
        try:
            self.send = self._symmetric(nbytes, dtype=torch.uint8)
            self.recv = self._symmetric(nbytes, dtype=torch.uint8)
        except RuntimeError as err:
            raise ValueError(
                f"could not allocate the NVSHMEM workspace (2 x {nbytes / 2**20:.0f} MiB of "
                f"symmetric memory): raise NVSHMEM_SYMMETRIC_SIZE before the first allocation, "
                f"or use StashConfig(transport='fixed'). NVSHMEM said: {err}") from err
        self.nbytes = nbytes

    def _rows_view(self, buffer, width, dtype):
        """``buffer`` as ``[N, stride]`` of ``dtype``: the op's input or output view."""
        stride = row_stride(width, dtype)
        flat = buffer.view(dtype)
        rows = flat.numel() // stride
        return flat[:rows * stride].view(rows, stride)

    def send_view(self, rows: int, row_shape, dtype) -> torch.Tensor:
        """``[rows, *row_shape]`` in the send buffer; contiguous when a row is 64-byte aligned
        (then a gather can write straight into it with ``out=``)."""
        width = math.prod(row_shape)
        self.reserve(bytes_for(rows, width, dtype))
        view = self._rows_view(self.send, width, dtype)[:rows, :width]
        return view.reshape(rows, *row_shape) if view.is_contiguous() else view

    def exchange(self, data: torch.Tensor, splits: torch.Tensor, out_rows: int) -> torch.Tensor:
        """Send ``data [n, ...]`` (rows by destination, packed: ``splits[d]`` rows to rank
        ``d``, int64 on the device) and receive ``[out_rows, ...]`` by source, packed, rows
        past the received ones unspecified. The result is a view of the receive buffer, valid
        until the next exchange on this group: read it right away."""
        rows, row_shape, dtype = data.shape[0], data.shape[1:], data.dtype
        width = math.prod(row_shape)
        self.reserve(bytes_for(max(rows, out_rows), width, dtype))
        send = self._rows_view(self.send, width, dtype)
        if data.data_ptr() != send.data_ptr() or data.stride(0) != send.stride(0):
            send[:rows, :width].copy_(data.reshape(rows, width))
        recv = self._rows_view(self.recv, width, dtype)
        self.in_splits.copy_(splits)
        all_to_all_vdev(send, recv, self.in_splits, self.out_splits, self.name)
        # every rank has finished reading every send buffer before any rank goes on
        dist.all_reduce(self.token, group=self.group)
        out = recv[:out_rows, :width]
        # padded rows (a row under 64 bytes, or not a multiple): a contiguous copy, since the
        # readers (gather_sum, index_select into kernels) take contiguous rows
        return out.contiguous().reshape(out_rows, *row_shape)
