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
            "offloaded": offloaded}


def test_an_offloaded_step_is_split_into_the_hosts_parts_and_the_copies(capsys, monkeypatch):
    """Each part in ms; the overlap is the host's optimizer, casts and the two copies summed
    (10 ms) less the optimizer's span on the device's clock (5 ms)."""
    import pagedstash_func.cli.bench._train as train
    monkeypatch.setattr(train, "host_rss_peak", lambda: 5 * 2**30)
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
    monkeypatch.setattr(train, "print_profile", lambda path, run, rows: (run(), {"GEMM": 0.002})[1])
    profiled = train.bench_train(paths=("exact",), profile=True, **kw)
    assert profiled["exact"]["kinds"] == {"GEMM": 0.002}
    assert "CUDA ms by kind of kernel" in capsys.readouterr().out


def test_kernels_are_sorted_into_kinds_and_tabled_side_by_side(capsys):
    """Kernel names as the profiler gives them (cuBLAS, flash attention, Inductor's fused and
    template kernels, one named after the attention it fuses around, psf's Triton kernels by
    name and another library's that looks like one, copies and casts, eager elementwise)
    into their kinds; then a table of the kinds by path."""
    from pagedstash_func.cli.bench._common import kernel_kinds
    from pagedstash_func.cli.bench._train import _kind_rows
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": 0.010,
             "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": 0.002,
             "triton_tem_fused_mm_0": 0.001,
             "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": 0.004,
             "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 0.001,
             "triton_poi_fused__scaled_dot_product_flash_attention__to_copy_add_0": 0.002,
             "triton_poi_fused_add_mul_0": 0.001, "triton_red_fused_sum_1": 0.001,
             "_swiglu_forward_kernel": 0.002, "_cross_entropy_rows_kernel": 0.0015,
             "_sampled_addmm_kernel": 0.0005,
             "Memcpy DtoD (Device -> Device)": 0.0005,
             "void at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": 0.0005,
             "void at::native::vectorized_elementwise_kernel<4, ...>": 0.0020}
    kinds = kernel_kinds(names, psf_names={"_swiglu_forward_kernel",
                                           "_cross_entropy_rows_kernel"})
    assert kinds == pytest.approx({
        "LM loss (psf's cross-entropy)": 0.0015, "psf's Triton kernels": 0.002,
        "attention": 0.005, "GEMM": 0.013, "fused by the compiler": 0.004,
        "copies, casts and fills": 0.001,
        "other (eager elementwise, reductions, indexing)": 0.0025})
    assert sum(kinds.values()) == pytest.approx(sum(names.values()))
    _kind_rows({"graphed": {"kinds": kinds}, "compiled-graphed": {"kinds": {"GEMM": 0.012}},
                "exact": {"kinds": None}, "transformers": None})
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("CUDA ms by kind"))
    assert out[head].split()[-2:] == ["graphed", "compiled-graphed"]
    gemm = next(line for line in out if line.startswith("GEMM"))
    assert gemm.split()[-2:] == ["13.0", "12.0"]
    assert next(line for line in out if line.startswith("sum")).split()[-2:] == ["29.0", "12.0"]


def test_only_the_devices_own_events_are_counted():
    """An annotation of a region spans kernels already counted, and a CPU op's device time
    is its kernels': each would count them twice."""
    from types import SimpleNamespace as Event

    from pagedstash_func.cli.bench._common import kernel_seconds
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [Event(key="sm90_xmma_gemm", device_type=cuda, self_device_time_total=3000,
                    is_user_annotation=False),
              Event(key="Torch-Compiled Region: 0/0", device_type=cuda,
                    self_device_time_total=3000, is_user_annotation=True),
              Event(key="aten::mm", device_type=cpu, self_device_time_total=3000,
                    is_user_annotation=False)]
    assert kernel_seconds(events) == {"sm90_xmma_gemm": 0.003}


def test_psfs_kernels_are_known_by_their_names():
    pytest.importorskip("triton")
    from pagedstash_func.cli.bench._common import kernel_kinds, psf_kernel_names
    names = psf_kernel_names()
    assert {"_cross_entropy_rows_kernel", "_swiglu_forward_kernel", "_write_pages_kernel",
            "_rms_norm_backward_kernel"} <= names
    assert kernel_kinds({"_write_pages_kernel": 1.0, "_sampled_addmm_kernel": 2.0}) == {
        "psf's Triton kernels": 1.0, "other (eager elementwise, reductions, indexing)": 2.0}


def test_the_largest_size_that_fits_is_found_by_doubling_then_bisection():
    """Each size asked once, doubling from 1 then bisecting; 0 when nothing fits; below the
    limit, which is never asked (--max-tokens' probes, --tokens auto's plans)."""
    from pagedstash_func.cli.bench._common import largest_fitting
    for most in (0, 1, 2, 5, 100, 256, 300, 511, 2000):
        asked = []
        assert largest_fitting(lambda n: asked.append(n) or n <= most) == most
        assert len(asked) == len(set(asked)) and asked[0] == 1
        capped = []
        assert largest_fitting(lambda n: capped.append(n) or n <= most, limit=512) \
            == min(most, 511)
        assert 512 not in capped
    asked = []
    largest_fitting(lambda n: asked.append(n) or n <= 5)
    assert asked == [1, 2, 4, 8, 6, 5]
