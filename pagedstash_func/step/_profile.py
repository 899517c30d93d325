"""Routing profile: load per step, layer and rank, and the factors it recommends.

Feed it the reports of `run_step`; read a table, or take the records and plot them.
"""

from __future__ import annotations

import math

from ._runner import StepReport


class RoutingProfile:
    """Collects `StepReport`\\ s; recommends ``capacity_factor`` and ``cuda_factor``.

    A step reruns when some rank of some layer receives more than its budget, or when the
    stashed rows of the step need more pages than the pool has. So per step the smallest
    capacity factor that avoids a rerun is the largest rank load over the balanced reference,
    and the smallest CUDA factor is the rows the stash would need (non-padding pairs, counted
    before any drop, so a step that dropped pairs does not undersize the advice) over the
    balanced rows. The recommendation for a target rerun rate ``r`` is the ``1 - r`` quantile
    of each over the steps seen, rounded up to three decimals (rounding to the nearest could
    land a budget rows short).

    Attributes:
        records: one dict per (step, layer, rank): ``step``, ``layer``, ``rank``, ``load``,
            ``load_ratio``, ``stash_rows``, ``expert_imbalance``.
        steps: one dict per step: ``step``, ``max_load_ratio``, ``stash_ratio``, ``reran``,
            ``reasons``, ``factor``, ``rerun``, ``moved``, ``stash_bytes``.
    """

    def __init__(self):
        self.records: list[dict] = []     # one per (step, layer, rank)
        self.steps: list[dict] = []       # one per step

    def add(self, report: StepReport, move=None, factor: float | None = None) -> None:
        """Record one step's report.

        From an adaptive run, also its `LadderMove` and the capacity factor it ran at: `table`
        then summarises the run's factors and reruns, and ``steps`` holds them per step for a
        plot.

        Args:
            report: the step's `StepReport` (``res.report``).
            move: the step's `LadderMove` (``astate.moves[-1]``), from an adaptive run.
            factor: the capacity factor the step ran at (``astep.factor(astate)`` before the
                call; a tuple, one per layer, from a ladder with ``per_layer``).
        """
        step = len(self.steps)
        worst = 0.0
        stash_ratio = 0.0
        for layer in report.layers:
            for rank, (load, ratio) in enumerate(zip(layer.rank_load, layer.load_ratio)):
                self.records.append({"step": step, "layer": layer.name, "rank": rank,
                                     "load": load, "load_ratio": ratio,
                                     "stash_rows": layer.rows,
                                     "expert_imbalance": layer.expert_imbalance})
                worst = max(worst, ratio)
            # the pools are sized per (dtype, width) from one factor: the layer that needs the
            # most over its balanced rows sets it (layers of other shapes share no pool)
            balanced = layer.balanced_rows // layer.group_size
            stash_ratio = max(stash_ratio, layer.stash_rows_needed / balanced if balanced else 0)
        rerun = move.rerun if move is not None else ("exact" if report.reran else "")
        self.steps.append({"step": step, "max_load_ratio": worst,
                           "stash_ratio": stash_ratio,
                           "reran": report.reran, "reasons": tuple(report.reasons),
                           "factor": factor, "rerun": rerun,
                           "moved": move.why if move is not None and
                           move.rung != move.next_rung else "",
                           "stash_bytes": report.stash_bytes})

    def recommend(self, target_rerun_rate: float = 0.05, *, per_layer: bool = False) -> dict:
        """``{"capacity_factor", "cuda_factor"}`` for at most ``target_rerun_rate`` reruns.

        Each factor alone meets the target on the steps seen; both together may rerun up to
        twice as often. On steps not seen it is a quantile estimated from ``n`` steps, so a
        fresh step exceeds it with probability up to about ``target + 1 / (n + 1)``: profile
        more steps for a tighter promise. Needs at least one step.

        ``per_layer=True`` adds ``"layer_factors"`` (``{layer: factor}``, for
        `StashConfig.layer_factors`): every layer starts at the one factor, then each in
        turn (in call order) goes down as far as it can while the steps on which any layer
        would go over number at most ``floor(target * n)``. So together they meet the target
        on the steps seen (a step reruns if any layer goes over), and no layer's factor is
        above the one factor's.

        Args:
            target_rerun_rate: the share of steps that may rerun, in ``[0, 1)``.
            per_layer: add ``"layer_factors"``.

        Returns:
            ``{"capacity_factor": float, "cuda_factor": float}``, and ``"layer_factors"`` with
                ``per_layer=True``.

        Raises:
            ValueError: no step was added yet, or ``target_rerun_rate`` is outside ``[0, 1)``.
        """
        if not self.steps:
            raise ValueError("no steps profiled yet: call profile.add(res.report) first")
        if not 0 <= target_rerun_rate < 1:
            raise ValueError(f"target_rerun_rate must be in [0, 1), got {target_rerun_rate}")
        q = 1 - target_rerun_rate
        out = {"capacity_factor": _round_up(_quantile([s["max_load_ratio"]
                                                       for s in self.steps], q)),
               "cuda_factor": _round_up(_quantile([s["stash_ratio"] for s in self.steps], q))}
        if per_layer:
            out["layer_factors"] = self._layer_factors(target_rerun_rate,
                                                       out["capacity_factor"])
        return out

    def _layer_factors(self, target: float, one: float) -> dict:
        """Each layer's factor, lowered from the one factor ``one`` in call order while the
        steps that any layer would overflow stay within ``floor(target * n)``."""
        need: dict = {}                        # layer -> step -> largest rank load ratio
        for r in self.records:
            steps = need.setdefault(r["layer"], {})
            steps[r["step"]] = max(steps.get(r["step"], 0.0), r["load_ratio"])
        n = len(self.steps)
        allowed = math.floor(target * n)
        names = sorted(need, key=_layer_order)

        def over(name, factor):
            return {s for s, v in need[name].items() if v > factor}
        factors = {name: one for name in names}
        for i, name in enumerate(names):
            later = set().union(*(over(m, one) for m in names[i + 1:]))
            earlier = set().union(*(over(m, factors[m]) for m in names[:i]))
            for cand in sorted({_round_up(v) for v in need[name].values()} | {one}):
                if cand > one:
                    break
                if len(earlier | later | over(name, cand)) <= allowed:
                    factors[name] = cand
                    break
        return factors

    def table(self, targets=(0.0, 0.01, 0.05, 0.2)) -> str:
        """A readable summary of the steps seen.

        Per layer the mean and max rank load ratio, the mean and max expert imbalance (busiest
        expert over the mean), then factors: for an adaptive run the factors it ran at and its
        reruns, and the recommendation at each target rerun rate.

        Args:
            targets: the target rerun rates to recommend factors for.

        Returns:
            The summary, lines joined by newlines.

        Raises:
            ValueError: no step was added yet.
        """
        lines = [f"{len(self.steps)} steps, {sum(s['reran'] for s in self.steps)} reran"]
        layers = sorted({r["layer"] for r in self.records}, key=_layer_order)
        lines.append(f"{'layer':<8} {'mean load/bal':>13} {'max load/bal':>12} "
                     f"{'mean stash rows':>15} {'expert max/mean':>15} {'worst':>6}")
        for name in layers:
            recs = [r for r in self.records if r["layer"] == name]
            ratios = [r["load_ratio"] for r in recs]
            rows = [r["stash_rows"] for r in recs]
            skew = [r["expert_imbalance"] for r in recs if r["rank"] == 0]
            lines.append(f"{name:<8} {sum(ratios) / len(ratios):>13.3f} {max(ratios):>12.3f} "
                         f"{sum(rows) / len(rows):>15.0f} {sum(skew) / len(skew):>15.2f} "
                         f"{max(skew):>6.2f}")
        factors = [s["factor"] for s in self.steps if s["factor"] is not None]
        if factors:
            counts = {f: factors.count(f) for f in sorted(set(factors))}
            at_rung = sum(s["rerun"].startswith("cf") for s in self.steps)
            if isinstance(factors[0], tuple):         # a factor per layer: the mean of each
                mean = "(" + ", ".join(f"{sum(col) / len(col):.3f}"
                                       for col in zip(*factors)) + ")"
            else:
                mean = f"{sum(factors) / len(factors):.3f}"
            lines.append(f"capacity factor: first {factors[0]}, last {factors[-1]}, mean "
                         f"{mean}; steps at each: {counts}; "
                         f"{sum(bool(s['moved']) for s in self.steps)} moves; reruns at a "
                         f"rung {at_rung}, exact "
                         f"{sum(s['rerun'] == 'exact' for s in self.steps)}")
        lines.append(f"{'target rerun rate':>17} {'capacity_factor':>16} {'cuda_factor':>12}")
        for t in targets:
            rec = self.recommend(t)
            lines.append(f"{t:>17.0%} {rec['capacity_factor']:>16.3f} "
                         f"{rec['cuda_factor']:>12.3f}")
        return "\n".join(lines)


def _round_up(x: float, decimals: int = 3) -> float:
    """``x`` rounded up to ``decimals`` (the inner round drops float noise such as
    1250.0000000000002, which would otherwise round 1.25 up to 1.251), at least one unit of
    the last decimal (a factor of 0, from steps with no tokens, is not a valid config)."""
    scale = 10 ** decimals
    return max(1, math.ceil(round(x * scale, 6))) / scale


def _quantile(values: list[float], q: float) -> float:
    """The smallest value with at least a fraction ``q`` of ``values`` at or below it."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def _layer_order(name: str):
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)
