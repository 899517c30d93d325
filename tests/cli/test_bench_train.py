"""`bench train`: its report of where a step goes, held to the figures it is given, and the
bench's own code run whole on the CPU with CUDA's clocks and memory counters stood in (the
figures themselves need a GPU)."""

import time

import pytest
import torch

from pagedstash_func.cli.bench._train import _split_rows


def _row(offloaded):
    split = {"grads": 0.100, "optimizer": 0.005}
    if offloaded:
        split |= {"host_wall": 0.0095, "host_gradients": 0.0005, "host_optimizer": 0.004,
                  "host_cast": 0.001, "host_wait": 0.002, "host_to_host": 0.003,
                  "host_to_device": 0.002}
    return {"split": split, "state_bytes": 3 * 2**30, "pinned_bytes": 2**29 if offloaded else 0,
            "offloaded": offloaded, "host_rss_peak": 5 * 2**30}


def test_an_offloaded_step_is_split_into_the_hosts_parts_and_the_copies(capsys):
    """Each part in ms; the overlap is the host's optimizer, casts and the two copies summed
    (10 ms) less the optimizer's span on the device's clock (5 ms)."""
    _split_rows({"stash-layer": _row(True), "transformers": None})
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("where it goes"))
    assert out[head].split()[-1] == "overlap"
    assert out[head + 1].split() == ["stash-layer", "100.0", "5.0", "9.5", "0.5", "4.0", "1.0",
                                     "2.0", "3.0", "2.0", "5.0"]
    state = next(line for line in out if "optimizer state" in line)
    assert "3.00 GiB in host memory, 0.50 GiB pinned" in state
    assert sum("peak host memory: 5.0 GiB" in line for line in out) == 1


def test_a_step_on_the_gpu_alone_has_two_parts_and_no_host_columns(capsys):
    _split_rows({"exact": _row(False)})
    out = capsys.readouterr().out
    assert "overlap" not in out and "AdamW" not in out
    assert "3.00 GiB on the GPU" in out and "pinned" not in out
    assert [line.split() for line in out.splitlines() if line.startswith("exact ")] \
        == [["exact", "100.0", "5.0"]]


def test_no_optimizer_prints_no_breakdown(capsys):
    _split_rows({"exact": {"split": None}, "stash": None})
    assert capsys.readouterr().out == ""


class _Event:
    """torch.cuda.Event on the host's clock."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def _on_the_cpu(monkeypatch):
    """CUDA's clocks and memory counters stood in, so the bench's own code runs here."""
    import pagedstash_func.cli.bench._train as train
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name, value in (("memory_allocated", 2**20), ("max_memory_allocated", 2**21),
                        ("memory_reserved", 2**22)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(train, "cuda_device", lambda device, what: torch.device("cpu"))
    monkeypatch.setattr(train, "device_name", lambda device: "cpu")
    return train


WIDTHS = dict(hidden=64, experts=4, ffn=32, top_k=2, vocab=128, heads=4, kv_heads=4,
              head_dim=16)


def test_bench_train_runs_whole_with_an_offloaded_optimizer(monkeypatch, capsys):
    """The bench's code end to end (transformers' path and psf's, the offloaded optimizer,
    the split, the plan), its timings on the host's clock: every path trains from the same
    weights, each step is split in its parts, and the state is 12 bytes a parameter."""
    pytest.importorskip("transformers")
    train = _on_the_cpu(monkeypatch)
    kw = dict(model="olmoe", layers=2, tokens=64, seq=32, iters=2, warmup=1,
              optimizer="adamw-offload", shape_overrides=WIDTHS)
    rows = train.bench_train(paths=("transformers", "exact", "stash-layer"), **kw)
    out = capsys.readouterr().out
    params = rows["exact"]["state_bytes"] // 12
    assert params > 0 and all(r["state_bytes"] == 12 * params for r in rows.values())
    for r in rows.values():
        assert r["offloaded"] and r["reruns"] == 0
        assert set(r["split"]) >= {"grads", "optimizer", "host_optimizer", "host_to_host",
                                   "host_gradients"}
        assert r["split"]["grads"] > 0 and r["split"]["host_optimizer"] > 0
    assert abs(rows["exact"]["loss"] - rows["stash-layer"]["loss"]) < 1e-2
    assert "where it goes" in out and out.count("GiB in host memory") == 3
    planned = train.bench_train(paths=("exact", "stash-layer"), plan=True, **kw)
    assert set(planned) == {"exact", "stash-layer"}
    assert "plan/measured" in capsys.readouterr().out
