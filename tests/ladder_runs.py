"""A run of an adaptive step saved mid-way and resumed, shared by the ladder's tests."""

import torch


def saved_and_resumed(make, loss, params, batch_of, at: int, end: int, path):
    """``make()`` (a `psf.adaptive` step) runs steps ``0 .. at - 1``, saves its step file
    at ``at`` and runs on to ``end``; a second ``make()`` loads the file and runs the same
    steps, each loss equal to the uninterrupted run's, bit for bit.

    Returns:
        ``(uninterrupted state, resumed state at the load, resumed state at the end,
            the batch the file held, the uninterrupted losses from ``at``)``.
    """
    astep = make()
    astate = astep.init(params, batch_of(0))
    for i in range(at):
        _, astate = astep(params, batch_of(i), astate)
    astep.save_step(path, params, batch_of(at), astate, check_loss_fn=False)
    tail = []
    for i in range(at, end):
        res, astate = astep(params, batch_of(i), astate)
        tail.append(res.loss)
    again = make()
    p2, saved_batch, loaded = again.load(path, loss, check_loss_fn=False)
    resumed = loaded
    for k, i in enumerate(range(at, end)):
        res, resumed = again(p2, batch_of(i), resumed)
        assert torch.equal(res.loss, tail[k]), (i, res.loss, tail[k])
    return astate, loaded, resumed, saved_batch, tail
