"""`StashConfig`: the knobs of a stash-aware step, validated once, frozen."""

from __future__ import annotations

import dataclasses
import math

_BACKENDS = ("auto", "triton", "torch")
TRANSPORTS = ("auto", "fixed", "nvshmem")   # expert-parallel row transports (`_symmetric`)
POOL_SCOPES = ("state", "layer")            # where a stashed tensor's pages live (`_pools`)
STASH_PRECISIONS = ("same", "fp8")           # what the activation input is stashed as
MAX_PAGE_SIZE = 4096   # rows: larger pages only waste the slack page each tensor keeps


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class StashConfig:
    """How a step sizes its expert buffers and where it stashes expert activations.

    Frozen; every field is checked once, when the config is made. Across real ranks,
    ``capacity_factor`` and ``expert_ranks`` must agree (budgets size the exchanges; ``step.init``
    refuses a mismatch on every rank); ``page_size``, ``cuda_factor``, ``host_factor`` and
    ``pool_scope`` may differ, since pages never leave their rank.

    Attributes:
        capacity_factor: rows per expert rank as a multiple of the balanced reference
            (``T*k/R`` for virtual ranks, ``T*k`` per real rank: docs/concepts/capacity.md);
            ``None`` runs the exact (dropless) path only. A budget is capped at what a rank
            can receive, so with ``expert_ranks=1`` on one device and a factor ``>= 1`` it
            never binds and nothing reruns for over budget: set ``expert_ranks`` to the
            expert-parallel size you want to reproduce.
        paged_stash: copy the valid rows of what the expert MLP saves for backward into pages
            of a pool (shared, or the layer's own: ``pool_scope``) instead of keeping the
            capacity-padded buffers alive.
        page_size: rows per page (default 64).
        cuda_factor: device pool size. ``>= 0``: a multiple of the balanced rows stashed per
            step; ``< 0``: ``|factor|`` times the rows observed in a profiling pass.
        host_factor: pinned host spill pool, same sign rule; ``0`` means no host pool.
        expert_ranks: expert-parallel size ``R`` (real or virtual ranks).
        backend: kernels to run: ``"auto"`` (Triton on CUDA, torch twins on CPU),
            ``"triton"`` or ``"torch"``.
        transport: how the capacity path moves rows between expert-parallel ranks:
            ``"nvshmem"`` (symmetric memory, only the kept rows travel), ``"fixed"`` (one
            equal-split all-to-all of ``budget`` rows per pair of ranks; gloo, or CUDA
            without NVSHMEM) or ``"auto"`` (``$PAGEDSTASH_TRANSPORT`` if set, else NVSHMEM
            where it runs). Both give the same bits.
        pool_scope: where the pages live. ``"state"``: one pool per (dtype, width), shared by
            every layer, allocated by ``step.init`` and carried in the state from step to
            step (a host tier is possible). ``"layer"``: each tensor an MoE call stashes gets a
            device pool of its own (``cuda_factor`` times its balanced rows, plus a slack
            page), allocated when the call's forward runs and freed when its backward is
            done, so the pages of layers whose backward has run no longer count at the end of
            backward, where the parameter gradients peak.
            Same bits either way; ``"layer"`` takes no host tier.
        stash_precision: ``"same"`` (default): the activation input (``gate_up``) is stashed
            in the experts' dtype, and gradients are those of the unstashed path bit for bit.
            ``"fp8"`` (opt-in, lossy): it is stashed as float8 e4m3 with one fp32 scale per
            row (its largest magnitude over 448), half the bytes of bf16; backward computes
            from the dequantised rows, so gradients differ from bf16's (BENCHMARKS.md reports
            by how much): the one setting under which `run_step`'s numbers are not the
            dropless ones (a step that reran is exact, one that did not is float8's).
            Needs ``paged_stash=True``.
        layer_factors: capacity factors of some layers by name, in place of
            ``capacity_factor`` there (a dict, or ``(name, factor)`` pairs): layers differ in
            skew (the first are often the most imbalanced), so one factor is too small for some
            and wasteful for others. In a `stash_aware` step the layers are ``"moe0"``,
            ``"moe1"``, ... in call order (``step.init`` refuses a name the loss does not
            call); by hand, the ``layer`` given to `moe_capacity`. Needs ``capacity_factor``
            (the other layers' factor). Kept as ``((name, factor), ...)`` sorted by name.

    Raises:
        ValueError: a field out of its range, or settings that do not go together
            (``paged_stash`` without ``capacity_factor``, ``stash_precision="fp8"`` without
            ``paged_stash``, ``pool_scope="layer"`` with a ``host_factor``, ``layer_factors``
            without ``capacity_factor``); the message names the field.

    Example::

        cfg = StashConfig(capacity_factor=1.25, paged_stash=True)
    """

    capacity_factor: float | None = None
    paged_stash: bool = False
    page_size: int = 64
    cuda_factor: float = 1.10
    host_factor: float = 0.0
    expert_ranks: int = 1
    backend: str = "auto"
    transport: str = "auto"
    pool_scope: str = "state"
    stash_precision: str = "same"
    layer_factors: tuple = ()

    def __post_init__(self):
        cf = self.capacity_factor
        if cf is not None and (not _finite_number(cf) or cf <= 0):
            raise ValueError(
                f"capacity_factor must be a positive finite number (e.g. 1.25) or None for the "
                f"exact path only; got {cf!r}")
        object.__setattr__(self, "layer_factors", _layer_factors(self.layer_factors, cf))
        if not isinstance(self.paged_stash, bool):
            raise ValueError(f"paged_stash must be True or False, got {self.paged_stash!r}")
        if self.paged_stash and cf is None:
            raise ValueError(
                "paged_stash=True needs a capacity_factor: pages hold rows of the capacity "
                "buffers. Set capacity_factor (e.g. 1.25) or paged_stash=False.")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) \
                or not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be an integer in [1, {MAX_PAGE_SIZE}] rows "
                             f"(default 64); got {self.page_size!r}")
        for name in ("cuda_factor", "host_factor"):
            value = getattr(self, name)
            if not _finite_number(value):
                raise ValueError(
                    f"{name} must be a finite number (>= 0: a multiple of the balanced rows; "
                    f"< 0: a multiple of the rows observed in a profiling pass); got {value!r}")
        if not isinstance(self.expert_ranks, int) or isinstance(self.expert_ranks, bool) \
                or self.expert_ranks < 1:
            raise ValueError(f"expert_ranks must be an integer >= 1 (1: no expert "
                             f"parallelism); got {self.expert_ranks!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}; got {self.backend!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}; got {self.transport!r}")
        if self.pool_scope not in POOL_SCOPES:
            raise ValueError(f"pool_scope must be one of {POOL_SCOPES} ('state': one pool "
                             f"shared by all layers and kept in the state; 'layer': a pool per "
                             f"MoE call, freed by its backward); got {self.pool_scope!r}")
        if self.stash_precision not in STASH_PRECISIONS:
            raise ValueError(f"stash_precision must be one of {STASH_PRECISIONS}; got "
                             f"{self.stash_precision!r}")
        if self.stash_precision != "same" and not self.paged_stash:
            raise ValueError(f"stash_precision={self.stash_precision!r} sets how the stash "
                             f"keeps the activation input: it needs paged_stash=True")
        if self.pool_scope == "layer" and self.host_factor != 0:
            raise ValueError(
                f"pool_scope='layer' allocates each layer's pool when its forward runs, on the "
                f"device only (pinning host memory every step would stop the host), so it takes "
                f"no host_factor (got {self.host_factor}): set host_factor=0, or use "
                f"pool_scope='state' for a host spill pool")

    @property
    def uses_capacity(self) -> bool:
        return self.capacity_factor is not None

    def factor_for(self, layer: str | None) -> float | None:
        """The capacity factor of the layer named ``layer``.

        Args:
            layer: a layer's name (``"moe0"``, ...), or ``None``.

        Returns:
            Its entry in ``layer_factors``, else ``capacity_factor`` (``None`` without one).
        """
        for name, factor in self.layer_factors:
            if name == layer:
                return factor
        return self.capacity_factor


def _layer_factors(value, capacity_factor) -> tuple:
    """``layer_factors`` as ``((name, float factor), ...)`` sorted by name, or `ValueError`."""
    if isinstance(value, dict):
        value = tuple(value.items())
    try:
        pairs = [tuple(pair) for pair in value]
    except TypeError:
        pairs = None
    if pairs is None or isinstance(value, (str, bytes)) or any(
            isinstance(p, str) for p in value) or any(
            len(p) != 2 or not isinstance(p[0], str) for p in pairs):
        raise ValueError(f"layer_factors takes {{layer name: capacity factor}}, e.g. "
                         f"{{'moe0': 1.5}}; got {value!r}")
    for name, factor in pairs:
        if not _finite_number(factor) or factor <= 0:
            raise ValueError(f"layer_factors[{name!r}] must be a positive finite capacity "
                             f"factor (e.g. 1.5); got {factor!r}")
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):
        raise ValueError(f"layer_factors names a layer twice: {sorted(names)}")
    if pairs and capacity_factor is None:
        raise ValueError("layer_factors sets some layers' capacity factors: it needs "
                         "capacity_factor too (the other layers' factor, e.g. 1.25)")
    return tuple(sorted((name, float(factor)) for name, factor in pairs))
