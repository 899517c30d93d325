"""`bench memory`: what is alive at the peak of one step, and who made it.

Records the CUDA caching allocator's history (`torch.cuda.memory._record_memory_history`) over
one run of each path, replays the allocation events to find the moment of the peak, and groups
the blocks alive then by the source line that allocated them (the innermost frame in this
package, in transformers, or else the innermost Python frame). Without ``--model``: one layer,
the paths of `bench peer`. With ``--model``: one whole-model step of `bench train`'s paths
(transformers' own model beside the same model through `from_hf_model`).
"""

from __future__ import annotations

import collections

import torch

import pagedstash_func as psf

from ._common import DTYPES, cuda_device, device_name
from ._common import path_runner
from ._peer import mixtral_block, ours_loss, peer_runner

_MINE = ("pagedstash_func", "transformers")


def alive_at_peak(run) -> tuple[int, list[tuple[str, int, int]]]:
    """``(peak bytes added, [(origin, bytes, blocks), ...] largest first)`` for one ``run()``:
    the bytes allocated during the run and alive at its peak (what was allocated before, such
    as the weights and a state's pools, is outside both)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        out = run()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del out
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    alive, now, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak = now, dict(alive)
        elif event["action"] == "free_completed" and event["addr"] in alive:
            now -= alive.pop(event["addr"])["size"]
    groups = collections.defaultdict(lambda: [0, 0])
    for event in at_peak.values():
        group = groups[_origin(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    return peak, sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda r: -r[1])


def _origin(frames) -> str:
    def where(f):
        return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    for f in frames:
        if any(m in f["filename"] for m in _MINE):
            return where(f)
    return where(frames[0]) if frames else "(no Python frame)"


def bench_memory(tokens=8192, hidden=2048, ffn=1408, experts=64, top_k=6, capacity_factor=1.25,
                 device=None, dtype_name="bf16", rows=8, seed=0):
    """Print, per path, the peak and the largest groups of blocks alive at it."""
    device = cuda_device(device, "bench memory")
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    batch = {"cotangent": torch.randn(tokens, hidden, generator=gen).to(device, dtype)}
    block = mixtral_block(hidden, ffn, experts, top_k, "grouped_mm", dtype, device, seed)
    params = {"moe": psf.from_hf_moe_block(block), "x": x}
    loss_fn = ours_loss(top_k)
    print(f"device: {device_name(device)}; one layer T={tokens} H={hidden} F={ffn} E={experts} "
          f"k={top_k} {dtype_name}, fwd+bwd; blocks alive at the peak, by allocating line")
    paths = [("transformers grouped_mm", lambda: (peer_runner(block, x, batch["cotangent"]), {})),
             ("psf exact", lambda: path_runner(loss_fn, params, batch, None)),
             ("psf capacity+stash", lambda: path_runner(
                 loss_fn, params, batch, psf.StashConfig(capacity_factor=capacity_factor,
                                                         paged_stash=True)))]
    for name, make in paths:
        run, box = make()
        run()                                   # warm up: compile, handles, workspaces
        peak, groups = alive_at_peak(run)
        pools = sum(t.numel() * t.element_size() for lay in box["state"].layouts
                    for t in box["state"].pools[lay.key][:2]) if box else 0
        print(f"--- {name}: peak {peak / 2**20:.0f} MiB above the start"
              + (f" (plus {pools / 2**20:.0f} MiB of stash pools, allocated by step.init)"
                 if pools else ""))
        for origin, size, count in groups[:rows]:
            print(f"  {size / 2**20:>8.0f} MiB  {count:>4} blocks  {origin}")
        del run
        torch.cuda.empty_cache()


MODEL_PATHS = ("transformers", "exact", "stash-layer")


def bench_memory_model(model="qwen3_moe", layers=None, tokens=None, seq=None,
                       paths=MODEL_PATHS, capacity_factor=1.25, device=None, rows=10, seed=0):
    """Per path of `bench train` (no optimizer): the peak of one whole-model step and the
    largest groups of blocks alive at it, by allocating line."""
    from . import _train
    unknown = [p for p in paths if p not in _train.PATHS or p in ("graphed", "func")]
    if unknown or not paths:
        raise ValueError(f"--paths {','.join(paths)}: choose from transformers, exact, "
                         f"capacity, stash, stash-layer")
    shape = _train.shape_of(model, layers=layers, tokens=tokens, seq=seq)
    device = cuda_device(device, "bench memory --model")
    print(f"device: {device_name(device)}; {shape.model}: {shape.layers} layers, H "
          f"{shape.hidden}, {shape.experts} experts x {shape.ffn}, top-{shape.top_k}, vocab "
          f"{shape.vocab}, T={shape.tokens} ({shape.batch} x {shape.seq}) bf16, one fwd+bwd "
          f"step; blocks alive at the peak, by allocating line", flush=True)
    model_hf = _train.build(shape, device, seed)
    batch = _train.make_batch(shape, device, seed)
    psf_model = None
    if any(p != "transformers" for p in paths):
        import copy
        own = model_hf if "transformers" not in paths else copy.deepcopy(model_hf)
        psf_model = psf.from_hf_model(own)
    for path in paths:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        if path == "transformers":
            run, box, _ = _train.hf_runner(model_hf, batch, optimizer=False)
        else:
            run, box, _ = _train.psf_runner(path, *psf_model, batch, capacity_factor,
                                            optimizer=False)
        pools = torch.cuda.memory_allocated() - before        # what step.init allocated
        run()                                                 # warm up: compile, workspaces
        peak, groups = alive_at_peak(run)
        print(f"--- {path}: peak {(peak + pools) / 2**20:.0f} MiB above the weights"
              + (f" ({pools / 2**20:.0f} MiB of it the state's pools, allocated by step.init)"
                 if pools else ""), flush=True)
        for origin, size, count in groups[:rows]:
            print(f"  {size / 2**20:>8.0f} MiB  {count:>5} blocks  {origin}")
        del run, box
    print("(a group: the blocks alive at the peak that one source line allocated; the lines "
          "are the innermost frames in pagedstash_func or transformers)", flush=True)
