"""The main job and the round-trip demo run from the command line (a few steps in CI)."""

import re

import pytest

from pagedstash_func.cli._main import main


def test_training_demo_runs_and_reports(capsys):
    assert main(["demo", "--steps", "4", "--no-progress", "--capacity-factor", "1.0"]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses and all(0 < x < 10 for x in losses)
    assert re.search(r"reruns: \d+ of 4 steps", out)
    assert "pages at peak" in out and "capacity-padded" in out


def test_training_demo_learns():
    from pagedstash_func.cli._demo import train
    out = train(25, progress=False, print_fn=lambda *_: None)
    first, last = sum(out["losses"][:3]) / 3, sum(out["losses"][-3:]) / 3
    assert last < first - 0.5


def test_stash_round_trip_demo(capsys):
    assert main(["stash-demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "host pages" in out and "bit for bit" in out


def test_demo_model_trains_a_transformers_model_through_from_hf_model(capsys):
    import pytest
    pytest.importorskip("transformers")
    assert main(["demo", "--model", "qwen3_moe", "--steps", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "transformers qwen3_moe model" in out and re.search(r"reruns: \d+ of 3 steps", out)
    from pagedstash_func.cli._demo import train
    res = train(12, model="olmoe", progress=False, print_fn=lambda *_: None)
    assert sum(res["losses"][-3:]) / 3 < sum(res["losses"][:3]) / 3 - 0.3
    assert res["model"].config.model_type == "olmoe"
    assert main(["demo", "--model", "llama"]) == 2
    assert "choose one of qwen3_moe, olmoe, mixtral, qwen2_moe, deepseek_v3" in \
        capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "mixtral"])
def test_demo_model_takes_every_supported_family(family, capsys):
    """The families the interop computes, each trained a few steps by the demo: the loss
    falls (a shared expert, DeepSeek-V3's grouped sigmoid router and its attention included)."""
    pytest.importorskip("transformers")
    from pagedstash_func.cli._demo import train
    res = train(6, model=family, progress=False, print_fn=lambda *_: None)
    assert res["model"].config.model_type == family
    assert res["losses"][-1] < res["losses"][0]


def test_bench_memory_flags_of_the_model_step_need_model(capsys):
    assert main(["bench", "memory", "--layers", "2"]) == 2
    assert "--layers needs --model" in capsys.readouterr().err
    assert main(["bench", "memory", "--model", "llama"]) == 2
    assert "choose one of olmoe, qwen3_moe, mixtral" in capsys.readouterr().err
    assert main(["bench", "memory", "--model", "olmoe", "--paths", "graphed"]) == 2
    assert "--paths graphed: choose from" in capsys.readouterr().err


def test_demo_bias_balancing_evens_the_expert_load(capsys):
    """Aux-loss-free balancing (psf.update_expert_bias between steps) against the same run
    without it: the busiest expert over the mean falls well below the unbalanced run's."""
    from pagedstash_func.cli._demo import train
    plain = train(40, progress=False, print_fn=lambda *_: None)
    biased = train(40, progress=False, print_fn=lambda *_: None, bias_rate=0.02)
    late = slice(-10, None)
    assert sum(biased["imbalance"][late]) < 0.7 * sum(plain["imbalance"][late])
    assert main(["demo", "--steps", "2", "--no-progress", "--bias-rate", "0.02"]) == 0
    assert "busiest over mean" in capsys.readouterr().out
    assert main(["demo", "--bias-rate", "-1"]) == 2


def test_bench_adaptive_runs_the_ladder_beside_each_rung(capsys):
    assert main(["bench", "adaptive", "--steps", "3", "--seeds", "1", "--no-progress",
                 "--per-layer", "--first-seed", "4"]) == 0
    out = capsys.readouterr().out
    assert "cf 2.0" in out and "adaptive / best" in out and "window 50" in out
    assert "seeds 4..4" in out and re.search(r"^4 ", out, re.M)
    assert re.search(r"^per layer: rerun rate [\d.]+ .* budget [\d.]+x", out, re.M)
    # 2 layers, 512 tokens of top-2 over 2 ranks: 512 balanced rows a rank, 1024 at cf 2.0;
    # the ladders start at the top rung
    for run in ("cf 2.0", "adaptive", "per layer"):
        assert re.search(rf"^{run} +[\d.]+ +[\d.]+ +2048 ", out, re.M), run


def _torchrun(tmp_path, *args):
    import os
    import subprocess
    import sys
    from worlds import free_port
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "4", "--master_port", str(free_port()), "-m", "pagedstash_func",
                           *args], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)


def test_demo_under_torchrun_on_a_dp_by_ep_mesh(tmp_path):
    """torchrun --nproc_per_node 4 ... demo --ep 2 --dp 2: experts over 2 ranks inside 2
    replicas."""
    run = _torchrun(tmp_path, "demo", "--ep", "2", "--dp", "2", "--steps", "3",
                    "--no-progress")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "experts spread over 2 of them, 2 data-parallel replicas" in run.stdout
    assert "rank 3:" in run.stdout and re.search(r"reruns: \d+ of 3 steps", run.stdout)


def test_the_benchmarks_run_on_a_dp_by_ep_mesh(tmp_path):
    """bench ep --dp 2 and bench train --ep 2 --dp 2 under torchrun, on gloo with tiny shapes
    (the figures come from GPUs; this holds the commands to working)."""
    run = _torchrun(tmp_path, "bench", "train", "--ep", "2", "--dp", "2", "--device", "cpu",
                    "--model", "qwen3_moe", "--layers", "1", "--tokens", "64", "--seq", "32",
                    "--shape", "hidden=32,experts=8,ffn=16,vocab=128,heads=2,kv_heads=2,"
                    "head_dim=16", "--paths", "transformers,capacity", "--iters", "1",
                    "--warmup", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--ep 2 --dp 2" in run.stdout and "4 a rank" in run.stdout
    assert re.search(r"^capacity .* 0/2 ", run.stdout, re.M), run.stdout
    run = _torchrun(tmp_path, "bench", "ep", "--dp", "2", "--device", "cpu", "--tokens", "32",
                    "--hidden", "16", "--ffn", "16", "--experts", "8", "--top-k", "2",
                    "--iters", "1", "--factors", "1.25", "--transports", "fixed")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "dp 2 x ep 2" in run.stdout and "reduce_gradients over the mesh" in run.stdout
    bad = _torchrun(tmp_path, "bench", "train", "--ep", "4", "--dp", "2", "--device", "cpu")
    assert bad.returncode != 0 and "needs 8 ranks, this run has 4" in bad.stderr + bad.stdout


def test_the_held_out_ratio_picks_on_one_half_and_times_on_the_other():
    """By hand: two fixed rungs, each fastest on one half of the steps, and the ladder; the
    halves are pairs of chunks (0, 1, 4, 5, ... against 2, 3, 6, 7, ...)."""
    from types import SimpleNamespace

    from pagedstash_func.cli.bench._adaptive import RunFigures, _halves, held_out_ratio
    run = SimpleNamespace(steps=list(range(8)), seconds=[9, 9, 1, 1, 4, 4, 1, 1])
    assert _halves(run, warmup=2, chunk=1) == (4, 1)       # steps 4, 5 | steps 2, 3, 6, 7
    assert _halves(run, warmup=2, chunk=2) == (1, 2.5)     # steps 2, 3 | steps 4 to 7
    assert _halves(run, warmup=6, chunk=4) == ()           # steps 6, 7: one half only
    fig = lambda halves: RunFigures(0, 0.0, None, halves=halves)
    a, b, ladder = fig((1.0, 3.0)), fig((2.0, 2.0)), fig((1.5, 2.4))
    # picked on half 0: a, timed on half 1: 2.4 / 3.0; picked on half 1: b, on half 0: 1.5 / 2
    assert held_out_ratio(ladder, [a, b]) == (2.4 / 3.0 + 1.5 / 2.0) / 2
    assert held_out_ratio(ladder, [a, fig(())]) is None
