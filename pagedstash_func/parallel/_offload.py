"""Host offload: an optimizer's fp32 master weights and state in host memory, stepped there a
bucket at a time while the device moves the next bucket's gradients and the last one's weights.

Per bucket (see `_zero`), on a CUDA device: the gradients are summed into one fp32 piece on
the device, copied to a pinned host slot on a side stream, stepped by the optimizer on the
host (``torch.optim.AdamW(fused=True)`` by default), converted to the parameters' dtype into a
second pinned slot and copied back on the side stream, where they are written into the
parameters. The host waits only for the bucket it is about to step; the device's own stream
waits for the side stream's last write before it runs what comes after the step (the next
forward), without the host waiting for it. Two slots a direction, each as wide as the widest
bucket, are all that is pinned: the masters and moments themselves are ordinary host memory,
written only by the host. On a CPU device the same loop runs with plain copies.

Each run keeps where its time went (`HostSteps.last_times`): the host's optimizer, its casts
and its waits on the host's clock, the copies on the side stream's.
"""

from __future__ import annotations

import time

import torch

__all__ = ["HostSteps"]

SLOTS = 2        # pinned slots a direction: one in flight while the host fills the other
PARTS = ("wall", "gradients", "optimizer", "cast", "wait", "to_host", "to_device")


class HostSteps:
    """The staging of an offloaded optimizer: pinned slots, the side stream, and the loop.

    Args:
        buckets: the optimizer's buckets (masters already on the host).
        device: the device the parameters live on.
    """

    def __init__(self, buckets, device: torch.device):
        elsewhere = {p.device for b in buckets for p in b.params} - {device}
        if elsewhere:
            raise ValueError(f"offload steps parameters on one device ({device}); these are "
                             f"also on {sorted(map(str, elsewhere))}: keep one process's "
                             f"parameters on its own device")
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._slots: dict = {}
        widths: dict = {}       # ("grad" or "weight", dtype) -> the widest bucket's width
        for b in buckets:
            for key in (("grad", b.dtype), ("weight", b.params[0].dtype)):
                widths[key] = max(widths.get(key, 0), b.width)
        for key, width in widths.items():                 # pinned once, at their widest
            self._slots[key] = [torch.empty(width, dtype=key[1], pin_memory=self.cuda)
                                for _ in range(SLOTS)]
        self._done = {}           # (key, slot) -> the event of the copy that last used it
        self._times: dict = {}    # the last finished run's host seconds, by part (PARTS)
        self._copies: list = []   # its copies: (direction, start event, end event)
        self._now: dict = {}      # the run under way's, alike
        self._now_copies: list = []

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held (0 on a CPU device: nothing is pinned)."""
        if not self.cuda:
            return 0
        return sum(s.nbytes for slots in self._slots.values() for s in slots)

    def run(self, buckets, pieces, optimizer, scale=None, done=None) -> None:
        """Step every bucket on the host; the parameters hold the new weights on return (on
        CUDA: in the device's stream order).

        Args:
            buckets: the optimizer's buckets, in order.
            pieces: ``pieces(i)`` makes bucket ``i``'s summed fp32 gradient piece on the
                device (called in order, one bucket ahead of the host's step).
            optimizer: the ``torch.optim`` optimizer over the buckets' masters.
            scale: a 0-d device tensor the gradients are multiplied by (clipping), or None.
            done: a one-element list counting the buckets stepped (for a failure part way).
        """
        if not buckets:
            return
        self._now = dict.fromkeys(PARTS, 0.0)        # this run's, kept once it finishes
        self._now_copies = []
        self._times, self._copies = {}, []
        start = time.perf_counter()
        ready = None
        if self.cuda:          # the gradients are made: what the host waits for first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        try:
            sent = self._send(buckets[0], 0, pieces(0), scale)
            for i, b in enumerate(buckets):
                ahead = self._send(buckets[i + 1], i + 1, pieces(i + 1), scale) \
                    if i + 1 < len(buckets) else None
                if ready is not None:      # (the first bucket's copy is already queued)
                    self._wait(ready, "gradients")
                    ready = None
                grad, event = sent
                if event is not None:
                    self._wait(event)
                b.master.grad = grad
                clock = time.perf_counter()
                try:
                    optimizer.step()       # only this bucket's master has a gradient
                finally:
                    b.master.grad = None
                    self._now["optimizer"] += time.perf_counter() - clock
                if done is not None:
                    done[0] += 1
                self._receive(b, i)
                sent = ahead
        finally:       # what runs next waits for every copy, even after a failure
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._now["wall"] = time.perf_counter() - start
        self._times, self._copies = self._now, self._now_copies     # a finished run's only

    def last_times(self) -> dict[str, float]:
        """Where the last finished `run` went, in seconds: ``wall`` (the host's whole run),
        ``gradients`` (the host blocked until the device had made the gradients: it was
        ahead of the backward), ``optimizer`` (the host's optimizer steps), ``cast`` (new
        masters rounded into the pinned slots), ``wait`` (the host blocked on copies and on
        slots still in use), and ``to_host`` / ``to_device`` (the copies: on CUDA the side
        stream's time from each copy's start to its end, summed over buckets, the writes into
        the parameters included in ``to_device``; on a CPU device the host's). On CUDA this
        blocks until that run's last copy is done: a diagnostic, read between steps. Empty
        before a run has finished (none ran, or the last one failed)."""
        times = dict(self._times)
        if self._copies:
            self._copies[-1][2].synchronize()
            for direction, begin, end in self._copies:
                times[direction] += begin.elapsed_time(end) / 1e3
        return times

    def _wait(self, event, part: str = "wait") -> None:
        """The host blocked until ``event`` is done, the time counted under ``part``."""
        clock = time.perf_counter()
        event.synchronize()
        self._now[part] += time.perf_counter() - clock

    def _slot(self, key, i: int, width: int) -> torch.Tensor:
        """Slot ``i % SLOTS`` of ``key``, once the copy that last used it is done."""
        event = self._done.pop((key, i % SLOTS), None)
        if event is not None:
            self._wait(event)
        return self._slots[key][i % SLOTS][:width]

    def _send(self, b, i: int, piece: torch.Tensor, scale):
        """Bucket ``i``'s gradient piece copied into a host slot: ``(host tensor, event)``."""
        if scale is not None:
            piece = piece * scale.to(piece.dtype)
        key = ("grad", b.dtype)
        host = self._slot(key, i, b.width)
        if not self.cuda:
            clock = time.perf_counter()
            host.copy_(piece)
            self._now["to_host"] += time.perf_counter() - clock
            return host, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            begin = self._mark()
            host.copy_(piece, non_blocking=True)
            piece.record_stream(self.stream)
            event = self._mark()
        self._now_copies.append(("to_host", begin, event))
        self._done[(key, i % SLOTS)] = event
        return host, event

    def _receive(self, b, i: int) -> None:
        """Bucket ``i``'s new master weights, in the parameters' dtype, into the parameters."""
        key = ("weight", b.params[0].dtype)
        host = self._slot(key, i, b.width)
        clock = time.perf_counter()
        host.copy_(b.master)
        self._now["cast"] += time.perf_counter() - clock
        if not self.cuda:
            clock = time.perf_counter()
            b.scatter(host.view(1, -1))
            self._now["to_device"] += time.perf_counter() - clock
            return
        with torch.cuda.stream(self.stream):
            begin = self._mark()
            rows = host.to(self.device, non_blocking=True)
            b.scatter(rows.view(1, -1))
            event = self._mark()
        self._now_copies.append(("to_device", begin, event))
        self._done[(key, i % SLOTS)] = event

    def _mark(self) -> torch.cuda.Event:
        """A timing event recorded on the current (side) stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event
