"""The demo's task under public names, for notebooks and scripts: a tiny MoE transformer on
characters (``python -m pagedstash_func demo`` trains it).

``text = corpus()``, ``params = init_model(vocab)``, ``batch = make_batch(data, step,
batch_size=16, seq=32, seed=0)``, ``loss, aux = loss_fn(params, batch)`` (a pure loss with
`psf.moe` layers), ``params, moments = adam(params, grads, moments, step)`` (a pure Adam
update), and ``train(steps, ...)``, the whole run the command line makes.
"""

from ._demo import adam, corpus, init_model, loss_fn, make_batch, train

__all__ = ["adam", "corpus", "init_model", "loss_fn", "make_batch", "train"]
