"""`python -m pagedstash_func train` on gloo ranks: a tiny Qwen3-MoE trained on a mesh, saved
on one mesh and resumed on another, against the run that was never interrupted."""

import os

import pytest
from worlds import no_failures, spawn_world

pytest.importorskip("transformers")

SHAPE = {"hidden": 64, "experts": 8, "ffn": 32, "vocab": 256, "heads": 4, "kv_heads": 2,
         "head_dim": 16, "top_k": 2}
ARGS = {"layers": 2, "tokens": 256, "seq": 128, "lr": 3e-3, "device": "cpu",
        "shape_overrides": SHAPE}


def _train(**kw):
    from pagedstash_func.cli._training import train
    return train("qwen3_moe", **{**ARGS, **kw})


def whole_then_halves(rank, world):
    """5 steps on ep 4; then 3 steps on ep 4 saved, and 2 more resumed on dp 2 x ep 2."""
    folder = os.environ["PSF_TRAIN_DIR"]
    whole = _train(ep=4, steps=5, paths=("stash-layer", "exact"))
    first = _train(ep=4, steps=3, save=os.path.join(folder, "ck"))
    rest = _train(ep=2, dp=2, steps=2, resume=os.path.join(folder, "ck"))
    return ({p: r["losses"] for p, r in whole.items()}, first["stash-layer"]["losses"],
            rest["stash-layer"]["losses"], whole["stash-layer"]["reruns"])


def test_a_run_saved_on_one_mesh_resumes_on_another_where_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("PSF_TRAIN_DIR", str(tmp_path))
    out = spawn_world(4, [whole_then_halves])["whole_then_halves"]
    no_failures(out)
    whole, first, rest, reruns = out[0]
    assert all(o == out[0] for o in out)            # the loss is the mean over the ranks
    stash, exact = whole["stash-layer"], whole["exact"]
    assert stash[-1] < stash[0] - 0.3                # it learns its batches
    assert reruns == 0
    # the capacity path at 1.25 drops nothing here: the exact path's numbers, to rounding
    assert stash == pytest.approx(exact, rel=2e-3)
    assert first == stash[:3]                        # the same start, the same steps
    # resumed on another mesh: where it stopped (the experts' gradients summed in another
    # order, so to rounding)
    assert rest == pytest.approx(stash[3:], rel=2e-3)
    assert abs(rest[0] - stash[3]) < abs(stash[3] - stash[2]) / 10


def test_bad_arguments_are_refused_by_name():
    from pagedstash_func.cli._training import train
    with pytest.raises(ValueError, match="take one path"):
        train("qwen3_moe", paths=("exact", "stash-layer"), save="x", device="cpu")
    with pytest.raises(ValueError, match="choose from"):
        train("qwen3_moe", paths=("transformers",), device="cpu")
    with pytest.raises(ValueError, match="CUDA graphs"):
        train("qwen3_moe", paths=("graphed",), device="cpu")
    with pytest.raises(ValueError, match="give --tokens on the CPU"):
        _train(tokens="auto", steps=1)
    with pytest.raises(ValueError, match="--lr must be"):
        _train(lr=float("nan"), steps=1)


def test_without_transformers_the_extra_is_named(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)        # as if not installed
    with pytest.raises(ValueError, match=r"pip install -e '.\[interop\]'"):
        _train(steps=1)


def test_a_save_path_is_checked_before_training(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="checked before training"):
        _train(steps=1, save=str(taken))
    with pytest.raises(ValueError, match="is not a checkpoint"):
        _train(steps=1, resume=str(taken))
    assert "step" not in capsys.readouterr().out          # nothing ran


def test_under_torchrun_without_ep_or_dp_every_rank_holds_experts(monkeypatch):
    from pagedstash_func.cli.bench._train_mesh import mesh_sizes
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert mesh_sizes(None, None, "train") == (4, 1)
    assert mesh_sizes(None, 2, "train") == (2, 2)
    assert mesh_sizes(1, None, "train") == (1, 4)
