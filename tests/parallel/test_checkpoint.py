"""Checkpoints on torch.distributed.checkpoint: ranks holding different experts under the
same key save and load on 1, 2 and 4 ranks (a (dp, ep) mesh and a process group), and
through to_hf_state_dict; a save killed halfway leaves the previous checkpoint; another
model's checkpoint is refused on every rank; a shard without its record is refused."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from worlds import no_failures, spawn_world

import pagedstash_func as psf

E, H, F = 8, 16, 24

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def _full():
    g = torch.Generator().manual_seed(0)
    return {"moe": psf.ExpertShard(psf.moe_init(E, H, F, generator=g, dtype=torch.float64)),
            "head": torch.randn(H, 3, generator=g, dtype=torch.float64)}


def _shard(tree, group):
    return {"moe": psf.shard_experts(tree["moe"], group), "head": tree["head"].clone()}


def _hf_model():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "interop"))
    from hf_tiny import tiny_model
    return tiny_model("qwen3_moe", experts=8).double()


def _same(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def _path(name):
    return os.path.join(os.environ["PSF_CKPT_DIR"], name)


def four_then_two(rank, world):
    """On a (dp 2, ep 2) mesh: load the one-process checkpoint, save another; then ranks 0
    and 1 alone (a group of 2) load it, each its own experts, and save a third."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    pair = dist.new_group([0, 1])
    full = _full()
    out = {}
    got = psf.load_checkpoint(_path("one"), _shard(full, mesh), mesh)              # 1 -> 4
    out["one_to_four"] = _same(got, _shard(full, mesh)) and \
        isinstance(got["moe"], psf.ExpertShard)
    doubled = pytree.tree_map(lambda t: t * 2 + 1, got)
    psf.save_checkpoint(_path("four"), doubled, mesh)
    model = _hf_model()
    params, _ = psf.from_hf_model(model, group=mesh)
    psf.save_checkpoint(_path("hf"), psf.to_hf_state_dict(params, model), mesh)
    try:                       # another tree's checkpoint: refused on every rank together
        psf.load_checkpoint(_path("hf"), doubled, mesh)
        out["foreign"] = ""
    except ValueError as err:
        out["foreign"] = str(err)
    odd = dict(doubled) if rank != 1 else {**doubled, "step": 3}   # one rank's bad tree
    try:
        psf.load_checkpoint(_path("four"), odd, mesh)
        out["one_bad"] = ""
    except ValueError as err:                      # every rank raises; none waits
        out["one_bad"] = str(err)
    moments = {"moe": {k: v for k, v in doubled["moe"].items() if k != "router"}}
    grads = {"a": torch.ones(2), "b": torch.ones(3)}
    for name, call in (("moments", lambda: psf.save_checkpoint(_path("m"), moments, mesh)),
                       ("order", lambda: psf.reduce_gradients(      # same keys, other order
                           grads if rank % 2 else dict(reversed(grads.items())), mesh))):
        try:
            call()
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    if rank < 2:                                                                  # 4 -> 2
        want = _shard(pytree.tree_map(lambda t: t * 2 + 1, full), pair)
        got = psf.load_checkpoint(_path("four"), _shard(full, pair), pair)
        out["four_to_two"] = _same(got, want)
        psf.save_checkpoint(_path("two"), pytree.tree_map(lambda t: t * 3, got), pair)
        small = _hf_model()
        mine, _ = psf.from_hf_model(small, group=pair)
        flat = psf.load_checkpoint(_path("hf"), psf.to_hf_state_dict(mine, small), pair)
        out["hf_four_to_two"] = _same(flat, psf.to_hf_state_dict(mine, small))
    # built on each rank's own experts: the single-process model's weights on its shard,
    # holding what build_bytes counts; built uninitialised, filled from a checkpoint
    config = _hf_model().config
    torch.manual_seed(1)
    whole, _ = psf.from_hf_model(_hf_model_from(config))
    torch.manual_seed(1)
    built, loss_fn = psf.from_hf_config(config, group=mesh)
    ep = mesh.get_local_rank("ep")
    out["built"] = all(
        torch.equal(built[k][n], v[ep * 4:(ep + 1) * 4] if n in psf.ExpertShard.SHARDED else v)
        if isinstance(built[k], psf.ExpertShard) else torch.equal(built[k], whole[k])
        for k in whole for n, v in (whole[k].items() if isinstance(whole[k], dict)
                                    else [(None, whole[k])]))
    counted = psf.build_bytes(config, ranks=2)
    out["bytes"] = loss_fn.built_bytes["held"] == counted["replicated"] + counted["experts"]
    empty, _ = psf.from_hf_config(config, group=mesh, init=False)
    out["loaded"] = _same(psf.load_checkpoint(_path("built"), empty, mesh), built)
    dist.barrier()
    return out


def _hf_model_from(config):
    import transformers
    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_checkpoint_moves_between_one_two_and_four_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("PSF_CKPT_DIR", str(tmp_path))
    full = _full()
    psf.save_checkpoint(tmp_path / "one", full)
    config = _hf_model().config
    torch.manual_seed(1)
    built, _ = psf.from_hf_model(_hf_model_from(config))
    psf.save_checkpoint(tmp_path / "built", built)
    values = spawn_world(4, [four_then_two])["four_then_two"]
    no_failures(values)
    for rank, out in enumerate(values):
        assert out["one_to_four"] and out["built"] and out["bytes"] and out["loaded"], \
            (rank, out)
        assert "another tree" in out["foreign"], (rank, out["foreign"])
        assert ("trees of tensors" if rank == 1 else "rank 1 refused") in out["one_bad"], \
            (rank, out["one_bad"])
        assert "w_gate_up and w_down with no router" in out["moments"], out["moments"]
        assert "the ranks passed different trees" in out["order"], out["order"]
        if rank < 2:
            assert out["four_to_two"] and out["hf_four_to_two"], rank
    doubled = pytree.tree_map(lambda t: t * 2 + 1, full)
    assert _same(psf.load_checkpoint(tmp_path / "four", full), doubled)           # 4 -> 1
    assert _same(psf.load_checkpoint(tmp_path / "two", full),                      # 2 -> 1
                 pytree.tree_map(lambda t: t * 3, doubled))
    model = _hf_model()
    params, _ = psf.from_hf_model(model)
    whole = psf.to_hf_state_dict(params, model)
    assert _same(psf.load_checkpoint(tmp_path / "hf", whole), whole)              # 4 -> 1
    meta = pytree.tree_map(lambda t: t.to("meta"), full)      # shapes only: made on the CPU
    assert _same(psf.load_checkpoint(tmp_path / "one", meta), full)
    left = sorted(os.listdir(tmp_path))
    assert all(not n.endswith((".tmp", ".link")) for n in left), left


KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    import torch.distributed.checkpoint as dcp
    import pagedstash_func as psf
    tree = {"w": torch.full((64, 64), 2.0), "b": torch.full((8,), 2.0)}
    write = dcp.FileSystemWriter.write_data
    def dying(self, plan, planner):
        os.kill(os.getpid(), signal.SIGKILL)        # killed while it writes the data
    dcp.FileSystemWriter.write_data = dying
    psf.save_checkpoint(sys.argv[1], tree)
""")


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    first = {"w": torch.ones(64, 64), "b": torch.ones(8)}
    psf.save_checkpoint(tmp_path / "ck", first)
    run = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path / "ck")],
                         capture_output=True, timeout=120)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path))       # it was writing
    assert _same(psf.load_checkpoint(tmp_path / "ck", first), first)
    second = pytree.tree_map(lambda t: t * 5, first)
    psf.save_checkpoint(tmp_path / "ck", second)                 # and the next save works
    assert _same(psf.load_checkpoint(tmp_path / "ck", first), second)
    assert sorted(n for n in os.listdir(tmp_path)) == sorted(
        ["ck", os.path.basename(os.readlink(tmp_path / "ck"))])        # nothing else left


def test_damaged_foreign_and_mismatched_checkpoints_are_refused(tmp_path):
    tree = _full()
    psf.save_checkpoint(tmp_path / "ck", tree)
    folder = os.path.realpath(tmp_path / "ck")
    with pytest.raises(ValueError, match=r"head has shape \[16, 3\] in the checkpoint"):
        psf.load_checkpoint(tmp_path / "ck", {**tree, "head": torch.zeros(16, 4,
                                                                         dtype=torch.float64)})
    with pytest.raises(ValueError, match="saved as torch.float64"):
        psf.load_checkpoint(tmp_path / "ck", pytree.tree_map(lambda t: t.float(), tree))
    with pytest.raises(ValueError, match="another tree: it lacks"):
        psf.load_checkpoint(tmp_path / "ck", {**tree, "extra": torch.zeros(2)})
    with pytest.raises(ValueError, match="no psf.json"):
        psf.load_checkpoint(tmp_path, tree)
    os.makedirs(tmp_path / "folder")
    with pytest.raises(ValueError, match="not a checkpoint link"):
        psf.save_checkpoint(tmp_path / "folder", tree)
    with pytest.raises(ValueError, match="trees of tensors"):
        psf.save_checkpoint(tmp_path / "x", {"step": 3})
    meta = os.path.join(folder, ".metadata")       # DCP's pickle, altered: never unpickled
    data = bytearray(open(meta, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(meta, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="does not match the checkpoint's manifest"):
        psf.load_checkpoint(tmp_path / "ck", tree)


def test_a_pickle_beyond_dcps_metadata_is_never_built(tmp_path):
    """Even with a manifest that vouches for it, a metadata pickle naming anything but DCP's
    metadata classes is refused before it builds it."""
    import hashlib
    import json
    import pickle
    tree = {"w": torch.ones(4)}
    psf.save_checkpoint(tmp_path / "ck", tree)
    folder = os.path.realpath(tmp_path / "ck")

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    data = pickle.dumps(Boom())
    open(os.path.join(folder, ".metadata"), "wb").write(data)
    manifest = json.load(open(os.path.join(folder, "psf.json")))
    manifest["metadata"] = hashlib.sha256(data).hexdigest()
    json.dump(manifest, open(os.path.join(folder, "psf.json"), "w"))
    with pytest.raises(ValueError, match="(posix|os).system, which a checkpoint"):
        psf.load_checkpoint(tmp_path / "ck", tree)
    assert not os.path.exists(tmp_path / "pwned")


def test_a_shard_without_its_record_is_refused_not_guessed():
    shard = {k: (v if k == "router" else v[:E // 2]) for k, v in _full()["moe"].items()}
    grads = {"moe": shard, "head": torch.zeros(H, 3)}       # a plain dict: the mark is gone
    for call in (lambda: psf.placements(grads), lambda: psf.clip_grad_norm(grads, 1.0),
                 lambda: psf.save_checkpoint("/tmp/never", grads),
                 lambda: psf.reduce_gradients(grads, None)):
        with pytest.raises(ValueError, match=r"tree\['moe'\] holds 4 experts of its router's 8"):
            call()
    marked = {"moe": psf.ExpertShard(shard), "head": torch.zeros(H, 3)}
    kinds = [w for _, _, w in psf.placements(pytree.tree_map(torch.zeros_like, marked))]
    assert kinds == ["replicated", "experts", "experts", "replicated"]     # tree_map keeps it
    model = _hf_model()
    params, _ = psf.from_hf_model(model)
    flat = psf.to_hf_state_dict(params, model)
    assert isinstance(flat, psf.HFStateDict) and not flat.experts          # nothing sharded
    cut = dict(flat)
    name = next(n for n in cut if n.endswith("experts.gate_up_proj"))
    cut[name] = cut[name][:2]
    with pytest.raises(ValueError, match="experts.gate_up_proj'\\] holds 2 experts"):
        psf.placements(cut)


def test_an_older_sharded_checkpoint_converts_to_one_any_rank_count_reads(tmp_path):
    """save_sharded (superseded: it warns) then `convert-checkpoint`: the tree comes back
    equal, its MoE layers marked as expert shards again."""
    from pagedstash_func.cli._main import main
    full = _full()
    with pytest.warns(DeprecationWarning, match="save_checkpoint"):
        psf.save_sharded(tmp_path / "old", full)
    assert main(["convert-checkpoint", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    back = psf.load_checkpoint(tmp_path / "new", full)
    assert _same(back, full) and isinstance(back["moe"], psf.ExpertShard)
    kinds = [w for _, _, w in psf.placements(back)]
    assert kinds == ["replicated", "experts", "experts", "replicated"]


def test_a_save_replaces_only_its_own_checkpoints_and_cleans_up_after_kills(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    os.symlink(precious, tmp_path / "latest")
    tree = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="not a checkpoint link"):
        psf.save_checkpoint(tmp_path / "latest", tree)
    assert (precious / "keep.txt").read_text() == "mine"
    psf.save_checkpoint(tmp_path / "deep" / "er" / "ck", tree)        # folders made
    first = os.path.realpath(tmp_path / "deep" / "er" / "ck")
    (tmp_path / "deep" / "er" / "ck.backup.tmp").mkdir()        # the user's, kept
    leftover = tmp_path / "deep" / "er" / "ck.0123456789ab"     # a save killed after rename
    leftover.mkdir()
    psf.save_checkpoint(tmp_path / "deep" / "er" / "ck", tree)
    left = sorted(os.listdir(tmp_path / "deep" / "er"))
    assert left == sorted(["ck", "ck.backup.tmp",
                           os.path.basename(os.path.realpath(tmp_path / "deep" / "er" / "ck"))])
    assert not os.path.exists(first)


def test_names_placements_and_data_paths_cannot_mislead_a_load(tmp_path):
    with pytest.raises(ValueError, match="not among its keys"):
        psf.HFStateDict({"m.experts.gate_up_proj": torch.zeros(2, 8, 4)},
                        experts=["m.experts.gate_up"])
    unlisted = psf.HFStateDict({"m.experts.gate_up_proj": torch.zeros(2, 8, 4),
                                "m.gate.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match="holds 2 experts of its router's 4"):
        psf.placements(unlisted)
    psf.save_checkpoint(tmp_path / "list", [torch.ones(2)])
    with pytest.raises(ValueError, match="another tree"):
        psf.load_checkpoint(tmp_path / "list", {"0": torch.ones(2)})
    assert _same(psf.load_checkpoint(tmp_path / "list", [torch.zeros(2)]), [torch.ones(2)])


def test_metadata_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    import dataclasses
    import hashlib
    import json
    import pickle
    psf.save_checkpoint(tmp_path / "ck", {"w": torch.ones(4)})
    folder = os.path.realpath(tmp_path / "ck")
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        metadata = pickle.load(f)                   # our own file, written just now
    metadata.storage_data = {k: dataclasses.replace(v, relative_path="../elsewhere.distcp")
                             for k, v in metadata.storage_data.items()}
    data = pickle.dumps(metadata)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(data)
    with open(os.path.join(folder, "psf.json")) as f:
        manifest = json.load(f)
    manifest["metadata"] = hashlib.sha256(data).hexdigest()
    with open(os.path.join(folder, "psf.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="outside the checkpoint's folder"):
        psf.load_checkpoint(tmp_path / "ck", {"w": torch.ones(4)})


def test_a_damaged_data_file_is_refused_not_read(tmp_path):
    tree = _full()
    psf.save_checkpoint(tmp_path / "ck", tree)
    folder = os.path.realpath(tmp_path / "ck")
    data = next(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp"))
    with open(data, "rb") as f:
        raw = bytearray(f.read())
    raw[len(raw) // 2] ^= 1
    with open(data, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(ValueError, match="missing or damaged"):
        psf.load_checkpoint(tmp_path / "ck", tree)
    with open(data, "ab") as f:                                 # and a longer file
        f.write(b"more")
    with pytest.raises(ValueError, match="missing or damaged"):
        psf.load_checkpoint(tmp_path / "ck", tree)


def test_a_tensor_under_two_names_is_clipped_and_counted_once():
    g = torch.full((4,), 3.0)
    norm = psf.clip_grad_norm({"embed": g, "head": g, "b": torch.full((4,), 4.0)}, 1.0)
    torch.testing.assert_close(norm, torch.tensor(10.0))         # sqrt(4 * 9 + 4 * 16)
    torch.testing.assert_close(g, torch.full((4,), 0.3), rtol=1e-5, atol=0)   # scaled once
