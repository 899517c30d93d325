"""Command line: ``demo`` (train), ``stash-demo``, ``bench stash|moe``."""

from __future__ import annotations

import argparse
import sys


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagedstash-func",
                                     description="pagedstash_func demos and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny MoE model with run_step (the main job)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    demo.add_argument("--capacity-factor", type=float, default=1.1)
    demo.add_argument("--expert-ranks", type=int, default=2)
    demo.add_argument("--cuda-factor", type=float, default=0.9)
    demo.add_argument("--host-factor", type=float, default=0.0)
    demo.add_argument("--no-stash", action="store_true", help="capacity without paged stash")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="log lines, no progress bar")
    round_trip = sub.add_parser("stash-demo", help="stash round trip: what went where")
    round_trip.add_argument("--device", default=None, help="cpu or cuda (default: cuda if "
                                                           "present)")

    bench = sub.add_parser("bench", help="benchmarks (figures, not tests)")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    b_stash = bench_sub.add_parser("stash", help="stash/pop bandwidth against Tensor.copy_")
    b_stash.add_argument("--hidden", type=_ints, default=[2048, 4096, 7168])
    b_stash.add_argument("--rows", type=_ints, default=[8192, 65536])
    b_stash.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    b_stash.add_argument("--page-size", type=int, default=64)
    b_stash.add_argument("--iters", type=int, default=20)
    b_stash.add_argument("--device", default=None)
    b_stash.add_argument("--block", type=int, default=0, help="override: elements per tile")
    b_stash.add_argument("--programs", type=int, default=0, help="override: grid size")
    b_stash.add_argument("--sweep", action="store_true", help="try launch sizes instead")

    b_moe = bench_sub.add_parser("moe", help="MoE layer fwd+bwd: exact vs capacity vs stash")
    b_moe.add_argument("--tokens", type=int, default=8192)
    b_moe.add_argument("--hidden", type=int, default=2048)
    b_moe.add_argument("--ffn", type=int, default=1408)
    b_moe.add_argument("--experts", type=int, default=64)
    b_moe.add_argument("--top-k", type=int, default=6)
    b_moe.add_argument("--capacity-factor", type=float, default=1.25)
    b_moe.add_argument("--expert-ranks", type=int, default=8)
    b_moe.add_argument("--iters", type=int, default=10)
    b_moe.add_argument("--pad-fraction", type=float, default=0.0,
                       help="share of tokens routed to padding (-1)")
    b_moe.add_argument("--cuda-factor", type=float, default=1.10)
    b_moe.add_argument("--profile", action="store_true", help="print CUDA time per kernel")
    b_moe.add_argument("--layers", type=int, default=1, help="MoE layers in the step")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo
        run_demo(args.steps, args.device, args.capacity_factor, args.expert_ranks,
                 not args.no_stash, args.cuda_factor, args.host_factor, args.seed,
                 progress=not args.no_progress)
    elif args.command == "stash-demo":
        from ._demo_stash import stash_round_trip
        stash_round_trip(device=args.device)
    elif args.what == "moe":
        from ._bench import bench_moe
        bench_moe(args.tokens, args.hidden, args.ffn, args.experts, args.top_k,
                  args.capacity_factor, args.expert_ranks, args.iters,
                  pad_fraction=args.pad_fraction, cuda_factor=args.cuda_factor,
                  profile=args.profile, layers=args.layers)
    elif args.what == "stash":
        from ._bench import bench_stash, sweep_launch
        if args.sweep:
            sweep_launch(args.hidden, args.rows, args.dtype, args.page_size, args.iters,
                         args.device)
        else:
            bench_stash(args.hidden, args.rows, args.dtype, args.page_size, args.iters,
                        args.device, (args.block, args.programs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
