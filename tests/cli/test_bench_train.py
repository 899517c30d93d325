"""`bench train`'s report of where a step goes: the timing itself needs CUDA (GPU tests run
the bench whole); these tests hold the printed breakdown to the figures it is given."""

from pagedstash_func.cli.bench._train import _split_rows


def _row(offloaded):
    split = {"grads": 0.100, "optimizer": 0.005}
    if offloaded:
        split |= {"host_wall": 0.009, "host_optimizer": 0.004, "host_cast": 0.001,
                  "host_wait": 0.002, "host_to_host": 0.003, "host_to_device": 0.002}
    return {"split": split, "state_bytes": 3 * 2**30, "pinned_bytes": 2**29 if offloaded else 0,
            "offloaded": offloaded, "host_rss_peak": 5 * 2**30}


def test_an_offloaded_step_is_split_into_the_hosts_parts_and_the_copies(capsys):
    """Each part in ms; parts/span is the host's optimizer, casts and the two copies summed
    (10 ms) over the optimizer's span on the device's clock (5 ms)."""
    _split_rows({"stash-layer": _row(True), "transformers": None})
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("where it goes"))
    assert out[head].split()[-1] == "parts/span"
    assert out[head + 1].split() == ["stash-layer", "100.0", "5.0", "4.0", "1.0", "2.0", "3.0",
                                     "2.0", "2.00"]
    state = next(line for line in out if "optimizer state" in line)
    assert "3.00 GiB in host memory, 0.50 GiB pinned" in state and "5.0 GiB" in state


def test_a_step_on_the_gpu_alone_has_two_parts_and_no_host_columns(capsys):
    _split_rows({"exact": _row(False)})
    out = capsys.readouterr().out
    assert "parts/span" not in out and "host AdamW" not in out
    assert "3.00 GiB on the GPU" in out and "pinned" not in out
    assert [line.split() for line in out.splitlines() if line.startswith("exact ")] \
        == [["exact", "100.0", "5.0"]]


def test_no_optimizer_prints_no_breakdown(capsys):
    _split_rows({"exact": {"split": None}, "stash": None})
    assert capsys.readouterr().out == ""
