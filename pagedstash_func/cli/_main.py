"""Command line: ``demo`` (train), ``stash-demo``,
``bench stash|moe|peer|memory|router|adaptive|ep|train|lm-loss``.

One function per subcommand; each imports what it runs only when chosen, and everything it
uses is public API (`pagedstash_func` names). A bad argument ends in one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


_HELP = {
    "--steps": "training steps", "--capacity-factor": "rows per expert rank over the "
    "balanced reference (docs/concepts/capacity.md)", "--cuda-factor": "device stash pool over the balanced "
    "rows (negative: over the rows observed at init)", "--host-factor": "pinned host spill "
    "pool, same rule (0: none)", "--seed": "seed of the model and the batches",
    "--tokens": "tokens per step (per rank under torchrun)", "--hidden": "hidden size H",
    "--ffn": "expert FFN size F", "--experts": "experts E", "--top-k": "experts per token k",
    "--iters": "timed iterations (median reported)", "--hidden-list": "hidden sizes",
    "--rows": "rows per buffer", "--dtype": "data type", "--page-size": "rows per page",
    "--block": "override: elements per tile", "--programs": "override: grid size",
    "--warps": "override: warps per program", "--sweep": "try launch sizes instead",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and the defaults shown in ``--help``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        kwargs.setdefault("help", _HELP.get(args[0], args[0].lstrip("-").replace("-", " ")))
        return super().add_argument(*args, **kwargs)

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device(text: str) -> str:
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return text


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="train a tiny MoE model with run_step (the main job)")
    demo.add_argument("--steps", type=_positive, default=60)
    demo.add_argument("--device", type=_device, default="cpu", help="cpu or cuda")
    demo.add_argument("--capacity-factor", type=float, default=1.1)
    demo.add_argument("--expert-ranks", type=_positive, default=2,
                      help="virtual expert ranks (must divide the demo's 8 experts); under "
                           "torchrun the experts are spread over the real ranks instead")
    demo.add_argument("--cuda-factor", type=float, default=0.9)
    demo.add_argument("--host-factor", type=float, default=0.0)
    demo.add_argument("--no-stash", action="store_true", help="capacity without paged stash")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                      help="compute dtype (fp32 master parameters either way)")
    demo.add_argument("--no-progress", action="store_true", help="log lines, no progress bar")
    demo.add_argument("--graph", action="store_true",
                      help="replay each step's attempt from a CUDA graph (needs --device cuda "
                           "--dtype bf16)")
    demo.add_argument("--model", default=None,
                      help="train a tiny random-init transformers model instead: qwen3_moe, "
                           "olmoe, mixtral, qwen2_moe or deepseek_v3, through "
                           "psf.from_hf_model (interop extra; its weights in --dtype)")
    demo.add_argument("--ep", type=_positive, default=None,
                      help="under torchrun: spread the experts over this many ranks, inside "
                           "WORLD_SIZE / ep data-parallel replicas (without it: all ranks)")
    demo.add_argument("--dp", type=_positive, default=None,
                      help="under torchrun: the data-parallel replicas of the ep groups "
                           "(WORLD_SIZE / ep; given with --ep it must agree)")
    demo.add_argument("--bias-rate", type=float, default=0.0,
                      help="aux-loss-free balancing: each layer's router_bias moves by this "
                           "much a step against its experts' load (psf.update_expert_bias; "
                           "0: no bias)")
    demo.set_defaults(run=_run_demo)
    trip = sub.add_parser("stash-demo", help="stash round trip: what went where")
    trip.add_argument("--device", type=_device, default=None,
                      help="cpu or cuda; None: cuda if present")
    trip.set_defaults(run=_run_stash_demo)


def _add_convert(sub) -> None:
    convert = sub.add_parser(
        "convert-checkpoint", help="an older save_sharded checkpoint as a save_checkpoint one")
    convert.add_argument("stem", help="the path given to save_sharded")
    convert.add_argument("path", help="the checkpoint to write (psf.load_checkpoint reads it "
                                      "on any number of ranks)")
    convert.set_defaults(run=_run_convert)


def _run_convert(args) -> None:
    import pagedstash_func as psf
    tree = psf.load_sharded(args.stem)                 # whole, every rank's file joined
    tree = _marked_whole(tree)
    folder = psf.save_checkpoint(args.path, tree)
    print(f"{args.stem} -> {args.path} ({folder})", flush=True)


def _marked_whole(tree):
    """A tree read whole by `load_sharded` (plain dicts), its MoE layers marked as expert
    shards of one rank, so that a load on several ranks splits them."""
    import torch.utils._pytree as pytree

    import pagedstash_func as psf

    def mark(node):
        if isinstance(node, dict) and not isinstance(node, psf.HFStateDict) \
                and {"router", "w_gate_up", "w_down"} <= set(node):
            return psf.ExpertShard(node)
        return node
    return pytree.tree_map(mark, tree, is_leaf=lambda n: isinstance(n, dict) and
                           {"router", "w_gate_up", "w_down"} <= set(n))


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (figures, not tests)")
    what = bench.add_subparsers(dest="what", required=True)
    for add in (_add_bench_stash, _add_bench_moe, _add_bench_peer_and_memory,
                _add_bench_router, _add_bench_adaptive, _add_bench_ep, _add_bench_train,
                _add_bench_lm_loss):
        add(what)


def _add_bench_moe(what) -> None:
    moe = what.add_parser("moe", help="MoE layer fwd+bwd: exact vs capacity vs stash")
    _add_layer_shape(moe)
    moe.add_argument("--expert-ranks", type=_positive, default=8)
    moe.add_argument("--pad-fraction", type=float, default=0.0,
                     help="share of tokens routed to padding (-1)")
    moe.add_argument("--cuda-factor", type=float, default=1.10)
    moe.add_argument("--host-factor", type=float, default=0.0,
                     help="pinned host spill pool over the balanced rows (0: none); pages that "
                          "do not fit the device pool go there instead of overflowing")
    moe.add_argument("--profile", action="store_true", help="print CUDA time per kernel")
    moe.add_argument("--layers", type=_positive, default=1, help="MoE layers in the step")
    moe.add_argument("--graph", action="store_true",
                     help="also time the capacity paths from a CUDA graph (psf.graphed)")
    moe.add_argument("--rounds", type=_positive, default=5,
                     help="with --graph: interleaved rounds over the graphed paths; the stash's "
                          "cost is the median of its per-round ratios")
    moe.add_argument("--compile", action="store_true",
                     help="also time the capacity path and the stash with pools per layer as "
                          "psf.compile steps (their first call, which compiles, reported)")
    moe.add_argument("--pool-scope", type=_pool_scopes, default="state", metavar="SCOPES",
                     help="state, layer or state,layer; one stash path per scope "
                          "(state: one pool kept in the state; layer: a pool per MoE call, "
                          "freed by its backward)")
    moe.set_defaults(run=_run_bench_moe)


def _add_bench_peer_and_memory(what) -> None:
    for name, runner, help_ in (
            ("peer", _run_bench_peer, "one layer beside transformers' Mixtral block"),
            ("memory", _run_bench_memory, "what is alive at the peak of one layer or model step")):
        cmd = what.add_parser(name, help=help_)
        _add_layer_shape(cmd)
        cmd.set_defaults(run=runner)
        if name == "memory":
            cmd.add_argument("--model", default=None,
                             help="olmoe, qwen3_moe, mixtral, qwen2_moe or deepseek_v3: one "
                                  "whole-model step of bench train's shape instead of one "
                                  "layer (interop extra)")
            cmd.add_argument("--layers", type=_positive, default=None,
                             help="with --model: decoder layers")
            cmd.add_argument("--seq", type=_positive, default=None,
                             help="with --model: tokens per sequence")
            cmd.add_argument("--paths", type=_names, default=None,
                             help="with --model: transformers, exact, capacity, stash, "
                                  "stash-layer (none given: transformers,exact,stash-layer)")
            cmd.set_defaults(tokens=None)


def _add_bench_router(what) -> None:
    router = what.add_parser("router", help="the cost of router options, load-balancing "
                                            "statistics and a shared expert")
    _add_layer_shape(router)
    router.add_argument("--shared-ffn", type=_positive, default=2816,
                        help="the shared expert's width")
    router.set_defaults(run=_run_bench_router)


def _add_bench_adaptive(what) -> None:
    adapt = what.add_parser("adaptive", help="a training run with psf.adaptive beside the "
                                             "same run at each fixed rung of its ladder")
    adapt.add_argument("--model", default="demo",
                       help="demo, or a tiny transformers model: qwen3_moe, olmoe, mixtral, "
                            "qwen2_moe or deepseek_v3")
    adapt.add_argument("--steps", type=_positive, default=100)
    adapt.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    adapt.add_argument("--seeds", type=_positive, default=2)
    adapt.add_argument("--first-seed", type=int, default=0,
                       help="the first seed (a long bench split over several commands)")
    adapt.add_argument("--target", type=float, default=0.02, help="target rerun rate")
    adapt.add_argument("--rungs", type=_floats, default=(1.0, 1.1, 1.25, 1.5, 2.0),
                       help="the ladder's capacity factors, comma-separated, increasing")
    adapt.add_argument("--expert-ranks", type=_positive, default=2,
                       help="virtual expert ranks a budget is counted over")
    adapt.add_argument("--device", type=_device, default="cpu")
    adapt.add_argument("--graph", action="store_true",
                       help="replay each attempt from CUDA graphs (bf16 experts on CUDA)")
    adapt.add_argument("--max-graphs", type=_positive, default=None,
                       help="rungs whose graphs the ladder keeps (with --graph; default all)")
    adapt.add_argument("--per-layer", action="store_true",
                       help="add a run of the ladder with a rung per MoE layer")
    adapt.add_argument("--batch-size", type=_positive, default=16,
                       help="windows of 32 characters a step")
    adapt.add_argument("--hidden", type=_positive, default=64, help="the model's width")
    adapt.add_argument("--ffn", type=_positive, default=96, help="each expert's width")
    adapt.add_argument("--chunk", type=_positive, default=10,
                       help="steps a run takes before the next run takes them (1: the runs "
                            "alternate every step)")
    adapt.add_argument("--no-progress", action="store_true")
    adapt.set_defaults(run=_run_bench_adaptive)


def _add_bench_stash(what) -> None:
    stash = what.add_parser("stash", help="stash/pop bandwidth against Tensor.copy_")
    stash.add_argument("--hidden", type=_ints, default=[2048, 4096, 7168])
    stash.add_argument("--rows", type=_ints, default=[8192, 65536])
    stash.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    stash.add_argument("--page-size", type=_positive, default=64)
    stash.add_argument("--iters", type=_positive, default=20)
    stash.add_argument("--device", type=_device, default=None)
    stash.add_argument("--block", type=int, default=0, help="override: elements per tile")
    stash.add_argument("--programs", type=int, default=0, help="override: grid size")
    stash.add_argument("--warps", type=int, default=0, help="override: warps per program")
    stash.add_argument("--sweep", action="store_true", help="try launch sizes instead")
    stash.add_argument("--valid", type=float, default=1.0,
                       help="share of the buffer's rows that are valid (capacity = rows / valid)")
    stash.add_argument("--expected", type=_expected, default=[1.0], metavar="FACTORS",
                       help="expected rows the kernels are given, over the valid rows, one "
                            "table row each (e.g. 0,1,1.25); the grid covers 3/4 of them, at "
                            "least 1/4 of the capacity; 0: no hint, a grid for the capacity")
    stash.add_argument("--pdl", type=_pdl_modes, default=["on"], metavar="MODES",
                       help="on and/or off (e.g. on,off), one table row each: the second "
                            "launch of the stash and the pop with programmatic dependent "
                            "launch where the GPU has it, or without (overrides "
                            "PAGEDSTASH_NO_PDL)")
    stash.add_argument("--anchor", default=None, metavar="MEGATRON_LM",
                       help="a Megatron-LM checkout: time its paged-stash kernels beside ours")
    stash.add_argument("--rounds", type=_positive, default=None,
                       help="interleaved rounds of graph replays per path, each share the "
                            "median over rounds (default 5; 3 with --sweep)")
    stash.add_argument("--floor", action="store_true",
                       help="also time a bare copy in the same tiles and grid, alone and paired "
                            "with a one-program launch as the stash and the pop are: what "
                            "their two launches reach on this GPU without a page table")
    stash.set_defaults(run=_run_bench_stash)


def _add_bench_ep(what) -> None:
    ep = what.add_parser("ep", help="expert-parallel layer per rank (run under torchrun)")
    _add_layer_shape(ep, capacity=False)
    ep.add_argument("--factors", type=_floats, default=[1.25, 1.5],
                    help="capacity factors to run")
    ep.add_argument("--cuda-factor", type=float, default=1.10)
    ep.add_argument("--transports", type=_transports, default=(),
                    help="comma-separated: nvshmem, fixed; empty: every one that runs here")
    ep.add_argument("--pool-scope", type=_pool_scopes, default="state", metavar="SCOPES",
                    help="state, layer or state,layer; one stash path per scope")
    ep.add_argument("--dp", type=_positive, default=1,
                    help="a (dp, ep) mesh of the ranks: experts over ep = ranks / dp, and "
                         "each step's gradients reduced over the mesh")
    ep.set_defaults(run=_run_bench_ep)


def _add_bench_train(what) -> None:
    train = what.add_parser("train", help="a whole transformers model per step, beside "
                                          "transformers itself (interop extra; GPU)")
    train.add_argument("--model", default="olmoe",
                       help="olmoe, qwen3_moe, mixtral, qwen2_moe or deepseek_v3")
    train.add_argument("--layers", type=_positive, default=None,
                       help="decoder layers (None: the model's figure shape)")
    train.add_argument("--tokens", type=_positive, default=None, help="tokens per step")
    train.add_argument("--seq", type=_positive, default=None, help="tokens per sequence")
    train.add_argument("--paths", type=_names, default=None,
                       help="comma-separated: transformers, exact, capacity, stash, "
                            "stash-layer, checkpoint (stash-layer with the attention blocks "
                            "recomputed), fp8 (stash-layer with a float8 stash), graphed, "
                            "func (torch.func.grad_and_value), compiled (stash-layer through "
                            "psf.compile), compiled-graphed (that step captured by "
                            "psf.graphed)")
    train.add_argument("--capacity-factor", type=float, default=1.25)
    train.add_argument("--iters", type=_positive, default=5)
    train.add_argument("--warmup", type=_positive, default=2)
    train.add_argument("--optimizer", default=None,
                       help="adamw: fp32 master weights + moments (torch.optim.AdamW through "
                            "psf.sharded_optimizer); adamw-offload: that state in host memory, "
                            "stepped there; adamw8bit: torchao's AdamW8bit; with --ep/--dp "
                            "also adamw-sharded: that state sharded over the ranks that "
                            "replicate each tensor (ZeRO-1)")
    train.add_argument("--plan", action="store_true",
                       help="print psf.plan_memory's peak beside each psf path's measured one")
    train.add_argument("--max-tokens", action="store_true",
                       help="find the most tokens per step each path fits (fresh processes)")
    train.add_argument("--loss-chunk", type=int, default=0,
                       help="rows per chunk of psf's LM loss (0: automatic; -1: transformers' "
                            "own head and loss)")
    train.add_argument("--profile", action="store_true",
                       help="CUDA time by kernel, per path, and by kind of kernel, the paths "
                            "side by side")
    train.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    train.add_argument("--device", type=_device, default="cuda")
    _add_mesh_and_shape(train)
    train.set_defaults(run=_run_bench_train)


def _add_bench_lm_loss(what) -> None:
    loss = what.add_parser("lm-loss", help="the LM head and its loss at a model's widths: "
                                           "full logits against psf.lm_loss's chunks, twin "
                                           "and kernel (GPU)")
    loss.add_argument("--model", default="qwen3_moe",
                      help="bench train's model whose hidden size and vocabulary are used")
    loss.add_argument("--tokens", type=_positive, default=None,
                      help="rows N (None: bench train's tokens for the model)")
    loss.add_argument("--chunk", type=_positive, default=None,
                      help="rows per chunk (None: psf.lm_loss's default)")
    loss.add_argument("--iters", type=_positive, default=10)
    loss.add_argument("--warmup", type=_positive, default=3)
    loss.add_argument("--device", type=_device, default="cuda")
    loss.set_defaults(run=_run_bench_lm_loss)


def _run_bench_lm_loss(args) -> None:
    from .bench._lm_loss import bench_lm_loss
    bench_lm_loss(args.model, args.tokens, args.chunk, args.iters, args.warmup, args.device)


def _add_mesh_and_shape(cmd) -> None:
    """``--ep``, ``--dp`` and ``--shape``, as bench train and train take them."""
    cmd.add_argument("--ep", type=_positive, default=None,
                     help="under torchrun: experts sharded over this many ranks")
    cmd.add_argument("--dp", type=_positive, default=None,
                     help="under torchrun: data-parallel replicas of the ep groups")
    cmd.add_argument("--shape", type=_shape, default=None,
                     help="override the model's widths, e.g. hidden=64,experts=8,ffn=32,"
                          "vocab=256,heads=4,kv_heads=2,head_dim=16")


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train a transformers MoE model on a (dp, ep) mesh "
                                         "of torchrun's ranks: ZeRO-1 AdamW, checkpoints, "
                                         "memory beside psf.plan_memory (interop extra)")
    train.add_argument("--model", default="qwen3_moe",
                       help="qwen3_moe, olmoe, mixtral, qwen2_moe or deepseek_v3 (the widths "
                            "of bench train's figures)")
    train.add_argument("--layers", type=_positive, default=None,
                       help="decoder layers (None: bench train's figure shape; 48 is "
                            "Qwen3-30B-A3B's whole depth)")
    train.add_argument("--tokens", type=_tokens, default=None,
                       help="tokens a rank a step, or auto (CUDA): the most whole sequences "
                            "whose planned peak fits 95%% of the GPU")
    train.add_argument("--seq", type=_positive, default=None, help="tokens per sequence")
    train.add_argument("--paths", type=_names, default=None,
                       help="comma-separated, each trained from the same start: exact, "
                            "capacity, stash-layer, graphed, compiled, compiled-graphed "
                            "(none given: stash-layer)")
    train.add_argument("--steps", type=_positive, default=20,
                       help="steps to run (after those a resumed checkpoint holds)")
    train.add_argument("--capacity-factor", type=float, default=1.25)
    train.add_argument("--lr", type=float, default=1e-4,
                       help="AdamW's learning rate (weight decay 0.01)")
    train.add_argument("--max-norm", type=float, default=1.0,
                       help="clip the global gradient norm to this")
    train.add_argument("--save", default=None,
                       help="write a checkpoint here after the steps (one path)")
    train.add_argument("--resume", default=None,
                       help="start from this checkpoint, on this run's mesh (one path)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", type=_device, default="cuda",
                       help="cuda, or cpu to rehearse on gloo ranks")
    _add_mesh_and_shape(train)
    train.set_defaults(run=_run_train)


def _tokens(text: str):
    return "auto" if text == "auto" else _positive(text)


def _run_train(args) -> None:
    from ._training import train
    train(args.model, ep=args.ep, dp=args.dp, layers=args.layers, tokens=args.tokens,
          seq=args.seq, paths=args.paths or ("stash-layer",), steps=args.steps,
          capacity_factor=args.capacity_factor, lr=args.lr, max_norm=args.max_norm,
          save=args.save, resume=args.resume, device=args.device, seed=args.seed,
          shape_overrides=args.shape)


def _names(text: str) -> tuple:
    names = tuple(dict.fromkeys(x for x in text.split(",") if x))      # each once, in order
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _shape(text: str) -> dict:
    out = {}
    for item in (x for x in text.split(",") if x):
        key, _, value = item.partition("=")
        if key in ("layers", "tokens", "seq"):
            raise argparse.ArgumentTypeError(f"--shape {key}=...: pass --{key} instead")
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected key=positive integer pairs such as "
                                             f"hidden=64,experts=8, got {item!r}")
        out[key] = int(value)
    return out


def _run_bench_train(args) -> None:
    from .bench._train import DEFAULT_PATHS, bench_train
    if args.ep or args.dp:
        from .bench._train_mesh import bench_train_mesh, mesh_sizes
        if args.max_tokens or args.profile:
            raise ValueError("--ep/--dp time steps as they are: drop --max-tokens and "
                             "--profile")
        ep, dp = mesh_sizes(args.ep, args.dp)
        bench_train_mesh(args.model, ep, dp, args.layers, args.tokens,
                         args.seq, args.paths or ("transformers", "exact", "capacity",
                                                  "stash-layer"),
                         args.capacity_factor, args.iters, args.warmup, device=args.device,
                         loss_chunk=args.loss_chunk, shape_overrides=args.shape,
                         optimizer=args.optimizer)
        return
    bench_train(args.model, args.layers, args.tokens, args.seq, args.paths or DEFAULT_PATHS,
                args.capacity_factor, args.iters, args.warmup, args.optimizer, args.max_tokens,
                device=args.device, probe=True if args.probe else None,
                loss_chunk=args.loss_chunk, profile=args.profile, shape_overrides=args.shape,
                plan=args.plan)


def _transports(text: str) -> tuple:
    names = tuple(x for x in text.split(",") if x)
    bad = [x for x in names if x not in ("nvshmem", "fixed")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected nvshmem and/or fixed, got {text!r}")
    return names


def _pool_scopes(text: str) -> tuple:
    names = tuple(dict.fromkeys(x for x in text.split(",") if x))
    if not names or any(x not in ("state", "layer") for x in names):
        raise argparse.ArgumentTypeError(f"expected state and/or layer, got {text!r}")
    return names


def _numbers(text: str, ok, wanted: str) -> list[float]:
    """Comma-separated numbers, each passing ``ok``; else an argparse error naming ``wanted``."""
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected {wanted}; got {text!r}")
    return values


def _expected(text: str) -> list[float]:
    return _numbers(text, lambda v: 0 <= v < 1e6,
                    "comma-separated factors >= 0 such as 0,1 (0: grid for the capacity)")


def _pdl_modes(text: str) -> list[str]:
    modes = [x for x in text.split(",") if x]
    if not modes or not set(modes) <= {"on", "off"}:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off; got {text!r}")
    return modes


def _floats(text: str) -> list[float]:
    return _numbers(text, lambda v: v > 0, "comma-separated positive numbers such as 1.25,1.5")


def _run_bench_ep(args) -> None:
    from .bench._ep import bench_ep
    bench_ep(args.tokens, args.hidden, args.ffn, args.experts, args.top_k, args.factors,
             args.iters, device=args.device, cuda_factor=args.cuda_factor,
             transports=args.transports, pool_scopes=args.pool_scope, dp=args.dp)


def _add_layer_shape(cmd, capacity: bool = True) -> None:
    cmd.add_argument("--tokens", type=_positive, default=8192)
    cmd.add_argument("--hidden", type=_positive, default=2048)
    cmd.add_argument("--ffn", type=_positive, default=1408)
    cmd.add_argument("--experts", type=_positive, default=64)
    cmd.add_argument("--top-k", type=_positive, default=6)
    if capacity:
        cmd.add_argument("--capacity-factor", type=float, default=1.25)
    cmd.add_argument("--iters", type=_positive, default=10)
    cmd.add_argument("--device", type=_device, default=None)


def _run_demo(args) -> None:
    import torch

    import pagedstash_func as psf
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device; use --device cpu")
    if args.graph and (args.device != "cuda" or args.dtype != "bf16"):
        raise ValueError("--graph replays CUDA graphs of bf16 experts: add --device cuda "
                         "--dtype bf16")
    if args.model is not None:
        import importlib.util
        if importlib.util.find_spec("transformers") is None:
            raise ValueError("--model needs transformers: pip install -e '.[interop]'")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp is not None:
        if args.ep is not None and args.ep * args.dp != ranks:
            raise ValueError(f"--ep {args.ep} --dp {args.dp} make {args.ep * args.dp} ranks, "
                             f"this run has {ranks}: torchrun --nproc_per_node "
                             f"{args.ep * args.dp} -m pagedstash_func demo ...")
        if ranks % args.dp:
            raise ValueError(f"--dp {args.dp} must divide WORLD_SIZE ({ranks}): under torchrun "
                             f"start a multiple of {args.dp} ranks")
        args.ep = args.ep or ranks // args.dp
    if args.ep is not None and (ranks % args.ep or 8 % args.ep):
        raise ValueError(f"--ep {args.ep} must divide WORLD_SIZE ({ranks}) and the demo's 8 "
                         f"experts")
    if ranks > 1 and args.ep is None and 8 % ranks:
        raise ValueError(f"the demo's 8 experts do not split over {ranks} ranks: start it with "
                         f"torchrun --nproc_per_node 2, 4 or 8")
    if 8 % args.expert_ranks:
        raise ValueError(f"--expert-ranks {args.expert_ranks} does not divide the demo's 8 "
                         f"experts: use 1, 2, 4 or 8")
    psf.StashConfig(capacity_factor=args.capacity_factor, paged_stash=not args.no_stash,
                    cuda_factor=args.cuda_factor, host_factor=args.host_factor)  # validates
    from ._demo import HF_MODELS, run_demo
    if args.model is not None and args.model not in HF_MODELS:
        raise ValueError(f"--model {args.model!r}: choose one of {', '.join(HF_MODELS)}")
    if args.model is not None and ranks > 1:
        raise ValueError("--model trains on one process: run it without torchrun")
    if not args.bias_rate >= 0 or (args.bias_rate and args.model is not None):
        raise ValueError(f"--bias-rate {args.bias_rate}: a rate >= 0, for the demo's own "
                         f"model (not with --model)")
    run_demo(args.steps, args.device, args.capacity_factor, args.expert_ranks,
             not args.no_stash, args.cuda_factor, args.host_factor, args.seed,
             progress=not args.no_progress,
             dtype=torch.bfloat16 if args.dtype == "bf16" else None, graph=args.graph,
             bias_rate=args.bias_rate, ep=args.ep,
             model=args.model)


def _run_stash_demo(args) -> None:
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device; use --device cpu")
    from ._demo_stash import stash_round_trip
    stash_round_trip(device=args.device)


def _run_bench_stash(args) -> None:
    from .bench._stash import bench_stash, sweep_launch
    if args.sweep:
        if args.anchor is not None or args.floor:
            raise ValueError("--anchor and --floor time beside our chosen launch; they do not "
                             "combine with --sweep (run them separately)")
        if args.valid != 1.0 or args.expected != [1.0] or args.pdl != ["on"]:
            raise ValueError("--sweep times every row valid, the kernels told the valid rows, "
                             "with PDL where the GPU has it; drop --valid, --expected and "
                             "--pdl (or run bench stash without --sweep)")
        sweep_launch(args.hidden, args.rows, args.dtype, args.page_size, args.iters,
                     args.device, rounds=args.rounds or 3)
    else:
        if not 0 < args.valid <= 1:
            raise ValueError(f"--valid must be in (0, 1], got {args.valid}")
        bench_stash(args.hidden, args.rows, args.dtype, args.page_size, args.iters,
                    args.device, (args.block, args.programs, args.warps), valid=args.valid,
                    anchor=args.anchor, expected=args.expected, pdl=args.pdl,
                    floor=args.floor, rounds=args.rounds or 5)


def _run_bench_moe(args) -> None:
    from .bench._moe import bench_moe
    bench_moe(args.tokens, args.hidden, args.ffn, args.experts, args.top_k,
              args.capacity_factor, args.expert_ranks, args.iters, device=args.device,
              pad_fraction=args.pad_fraction, cuda_factor=args.cuda_factor,
              host_factor=args.host_factor, profile=args.profile, layers=args.layers,
              graph=args.graph, pool_scopes=args.pool_scope, rounds=args.rounds,
              compiled=args.compile)


def _run_bench_peer(args) -> None:
    from .bench._peer import bench_peer
    bench_peer(args.tokens, args.hidden, args.ffn, args.experts, args.top_k,
               args.capacity_factor, args.iters, device=args.device)


def _run_bench_adaptive(args) -> None:
    from .bench._adaptive import bench_adaptive
    bench_adaptive(args.steps, args.seeds, target=args.target, device=args.device,
                   progress=not args.no_progress, model=args.model, graph=args.graph,
                   warmup=args.warmup, expert_ranks=args.expert_ranks, rungs=args.rungs,
                   max_graphs=args.max_graphs, first_seed=args.first_seed,
                   per_layer=args.per_layer, chunk=args.chunk, batch_size=args.batch_size,
                   hidden=args.hidden, ffn=args.ffn)


def _run_bench_router(args) -> None:
    from .bench._router import bench_router
    bench_router(args.tokens, args.hidden, args.ffn, args.experts, args.top_k,
                 args.capacity_factor, args.shared_ffn, args.iters, device=args.device)


def _run_bench_memory(args) -> None:
    from .bench._memory import MODEL_PATHS, bench_memory, bench_memory_model
    if args.model is not None:
        bench_memory_model(args.model, args.layers, args.tokens, args.seq,
                           args.paths or MODEL_PATHS, args.capacity_factor, device=args.device)
        return
    for flag in ("layers", "seq", "paths"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} needs --model (without it: one layer; set its shape "
                             f"with --tokens, --hidden, --ffn, --experts, --top-k)")
    bench_memory(args.tokens or 8192, args.hidden, args.ffn, args.experts, args.top_k,
                 args.capacity_factor, device=args.device)


def main(argv=None) -> int:
    parser = _Parser(prog="pagedstash-func", description="pagedstash_func demos and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_train(sub)
    _add_convert(sub)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, TypeError, MemoryError) as err:
        message = " ".join(str(err).split())
        where = " ".join(x for x in (args.command, getattr(args, "what", None)) if x)
        sys.stderr.write(f"pagedstash-func {where}: error: {message}\n")
        return 2
    return 0

