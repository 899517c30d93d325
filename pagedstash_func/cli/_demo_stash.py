"""A stash round trip a newcomer can read: what was stashed, where, and the bytes saved."""

from __future__ import annotations

import torch

import pagedstash_func as psf


def stash_round_trip(device=None, hidden=256, capacity=1024, valid=(700, 180, 955), seed=0):
    """Stash three capacity-padded buffers with few valid rows, pop them, check, print a report."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=True, page_size=64, cuda_factor=0.5,
                      host_factor=0.5)
    balanced = int(capacity / 1.25)
    names = [f"layer{i}/fc1_in" for i in range(len(valid))]
    specs = [psf.StashSpec(n, hidden, torch.bfloat16, capacity, balanced) for n in names]
    state = psf.init_stash_state(specs, cfg, device=device)
    gen = torch.Generator().manual_seed(seed)
    buffers = {n: torch.randn(capacity, hidden, generator=gen).to(device, torch.bfloat16)
               for n in names}
    lay = state.layouts[0]
    print(f"device {device}; pool bf16 x {hidden}: {lay.cuda_pages} device pages + "
          f"{lay.host_pages} host pages of {cfg.page_size} rows "
          f"({lay.page_bytes / 1024:.0f} KiB each)")
    for name, n in zip(names, valid):
        state = psf.stash(state, name, buffers[name], torch.tensor([n], device=device))
    padded = stored = 0
    for name, n in zip(names, valid):
        view = psf.table_view(state, name)
        where = [f"device pages {_ranges(view['cuda_pages'])}"] if view["cuda_pages"] else []
        where += [f"host pages {_ranges(view['host_pages'])}"] if view["host_pages"] else []
        print(f"  {name}: {view['rows']} of {capacity} rows in {len(view['pages'])} pages: "
              f"{', '.join(where)}")
        padded += capacity * hidden * 2
        stored += len(view["pages"]) * lay.page_bytes
    use = psf.pages_in_use(state)[f"bfloat16x{hidden}"]
    print(f"pages in use: {use['cuda_used']} device, {use['host_used']} host; "
          f"flags {psf.read_flags(state)}")
    print(f"stashed {stored / 2**20:.2f} MiB in pages against {padded / 2**20:.2f} MiB of "
          f"capacity-padded buffers: {1 - stored / padded:.0%} saved")
    for name, n in reversed(list(zip(names, valid))):
        out, state = psf.pop(state, name)
        ok = torch.equal(out[:n], buffers[name][:n]) and not out[n:].any()
        if not ok:
            raise RuntimeError(f"round trip of {name} lost data")
    use = psf.pages_in_use(state)[f"bfloat16x{hidden}"]
    print(f"popped all three back bit for bit (tails zero); pages in use now: "
          f"{use['cuda_used']} device, {use['host_used']} host")
    return state


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, p in enumerate(ids):
        if start is None:
            start = p
        if i + 1 == len(ids) or ids[i + 1] != p + 1:
            out.append(f"{start}-{p}" if p != start else f"{p}")
            start = None
    return ", ".join(out)
