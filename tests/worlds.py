"""Spawn a small torch.distributed world for a test, with timeouts everywhere."""

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_world(world, checks, backend="gloo"):
    """Run ``checks`` (module-level functions ``(rank, world) -> value``) on ``world`` ranks;
    returns ``{name: [value per rank]}`` (a value is ``"FAILED"`` and the traceback if the
    check raised; the rank then stops, since the others may wait in a collective)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, checks, out, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, values = out.get(timeout=TIMEOUT)
            for name, value in values.items():
                results.setdefault(name, [None] * world)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _worker(rank, world, port, checks, out, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    values = {}
    try:
        for check in checks:
            try:
                values[check.__name__] = check(rank, world)
            except Exception:
                values[check.__name__] = "FAILED\n" + traceback.format_exc()
                break
    finally:
        out.put((rank, values))
        dist.destroy_process_group()


def no_failures(values):
    bad = [v for v in values if isinstance(v, str) and v.startswith("FAILED")]
    assert not bad, bad[0]
