"""Saves are atomic: a process killed while it writes a checkpoint or a step file leaves the
file that was there before, whole and loadable."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedstash_func as psf

E, H, F = 4, 8, 12

# Run in a child process: every torch.save dies after writing its first record, as a process
# killed part-way through a save would (the zip archive is then cut short).
_DIE_WHILE_WRITING = """
import os, torch
_write = torch._C.PyTorchFileWriter.write_record
def _dying(self, *args, **kwargs):
    _write(self, *args, **kwargs)
    os._exit(3)
torch._C.PyTorchFileWriter.write_record = _dying
"""


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the child finds the package as this process did, installed or from the checkout
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
    ROOT, os.environ.get("PYTHONPATH"))))}


def _killed_halfway(body: str, tmp_path) -> None:
    code = _DIE_WHILE_WRITING + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=ENV)
    assert done.returncode == 3, done.stderr


def test_a_sharded_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    old = {"moe": psf.ExpertShard(psf.moe_init(E, H, F, dtype=torch.float64))}
    psf.save_sharded(tmp_path / "ck", old)
    _killed_halfway("""
        import torch, pagedstash_func as psf
        tree = {"moe": psf.ExpertShard(psf.moe_init(4, 8, 12, dtype=torch.float64))}
        tree["moe"] = psf.ExpertShard({k: v + 1 for k, v in tree["moe"].items()})
        psf.save_sharded("ck", tree)
    """, tmp_path)
    back = psf.load_sharded(tmp_path / "ck")
    for k, v in old["moe"].items():
        assert torch.equal(back["moe"][k], v)
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == ["ck.rank0-of-1.pt"]


def test_a_step_file_killed_halfway_leaves_the_previous_file(tmp_path):
    path = tmp_path / "step.pt"
    code = """
        import torch, pagedstash_func as psf
        def loss_fn(params, batch):
            return psf.moe(params, batch["x"], top_k=2).square().mean()
        g = torch.Generator().manual_seed({seed})
        params = psf.moe_init(4, 8, 12, generator=g, dtype=torch.float64)
        batch = {{"x": torch.randn(16, 8, generator=g, dtype=torch.float64)}}
        step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0))
        psf.save_step("step.pt", step, params, batch, step.init(params, batch),
                      check_loss_fn=False)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code.format(seed=0))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr
    before = path.read_bytes()
    _killed_halfway(code.format(seed=1), tmp_path)
    assert path.read_bytes() == before
    _, params, _, _ = psf.load_step(path, lambda p, b: None, check_loss_fn=False)
    want = psf.moe_init(4, 8, 12, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    assert torch.equal(params["router"], want["router"])


def test_a_save_that_raises_leaves_no_temporary_file(tmp_path):
    from pagedstash_func.core._files import save_atomic
    save_atomic({"a": torch.ones(2)}, tmp_path / "f.pt")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        save_atomic({"a": Unpicklable()}, tmp_path / "f.pt")
    assert os.listdir(tmp_path) == ["f.pt"]
    assert torch.equal(torch.load(tmp_path / "f.pt")["a"], torch.ones(2))


def test_a_save_writes_through_a_link_keeps_the_mode_and_names_the_users_path(tmp_path):
    from pagedstash_func.core._files import save_atomic
    target = tmp_path / "real.pt"
    save_atomic({"a": torch.zeros(1)}, target)
    os.chmod(target, 0o600)
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    save_atomic({"a": torch.ones(1)}, link)
    assert link.is_symlink() and torch.equal(torch.load(target)["a"], torch.ones(1))
    assert (target.stat().st_mode & 0o777) == 0o600
    long = tmp_path / ("n" * 250 + ".pt")                  # a legal name near the limit
    save_atomic({"a": torch.ones(1)}, long)
    with pytest.raises(FileNotFoundError) as err:
        save_atomic({"a": torch.ones(1)}, tmp_path / "missing" / "f.pt")
    assert err.value.filename == str(tmp_path / "missing" / "f.pt")


def test_a_save_of_another_size_replaces_the_earlier_one_and_a_folder_is_refused(tmp_path):
    tree = {"moe": psf.ExpertShard(psf.moe_init(E, H, F, dtype=torch.float64))}
    (tmp_path / "ck.rank0-of-2.pt").write_bytes(b"earlier")  # a 2-rank save's files
    (tmp_path / "ck.rank1-of-2.pt").write_bytes(b"earlier")
    (tmp_path / "ck.rank0-of-2.pt.bak").write_bytes(b"kept")  # not a checkpoint file
    psf.save_sharded(tmp_path / "ck", tree)
    assert sorted(os.listdir(tmp_path)) == ["ck.rank0-of-1.pt", "ck.rank0-of-2.pt.bak"]
    assert psf.load_sharded(tmp_path / "ck")["moe"]["w_down"].shape == (E, F, H)
    with pytest.raises(ValueError, match="file stem, not a folder"):
        psf.save_sharded(tmp_path, tree)
