"""`shard-node`: the node's command line. One function per subcommand.

Parses arguments and reports errors as one line; the work lives in the modules it calls
(shard.store for `prepare`). Knows nothing of how a store is laid out.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from shard.heap import bound_kernel_caches, freeze_startup_heap

bound_kernel_caches()  # before anything imports torch

from shard.errors import ShardError, sole_error
from shard.sources import ALIASES, DEFAULT_MODEL

PROG = "shard-node"


def add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="turn a model into a layer-addressable store (one-time, offline)",
                       description="Split a model into per-layer safetensors files plus a manifest of digests. "
                                   "Idempotent: an existing store is verified and left as is.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias ({', '.join(ALIASES)}), a local HF model dir, or a .gguf file (default: %(default)s)")
    p.add_argument("--out", default=None, help="store dir (default: $SHARD_HOME/models/<name>, "
                                               "SHARD_HOME defaulting to ~/.cache/shard)")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid store is already there")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from shard.store import prepare

    result = prepare(args.model, args.out, force=args.force, progress=not args.quiet)
    m = result.store.manifest
    what = "prepared" if result.created else "already prepared, digests verified, nothing to do:"
    kept = f", matmuls kept as {m.quant}" if m.quant != "none" else ""  # a GGUF's blocks (docs/quantisation.md)
    print(f"{what} {m.name} ({m.model_type}, {m.num_layers} layers, {m.dtype}{kept}) at {result.store.root}")
    print(f"digest {m.digest}")
    return 0


def add_join(sub: argparse._SubParsersAction) -> None:
    from shard.node import NodeConfig
    from shard.options import add_options

    p = sub.add_parser("join", help="join a coordinator's swarm and serve the layers it assigns",
                       description="Register with a coordinator, load the assigned slice of the model, serve ring frames.")
    add_options(p, NodeConfig)
    p.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    p.set_defaults(run=run_join)


def run_join(args: argparse.Namespace) -> int:
    import logging

    import trio

    from shard.join import run_node
    from shard.node import NodeConfig
    from shard.options import config_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(NodeConfig, args)
    except ValueError as exc:  # a value its config refuses (e.g. --seed-upload-share 2): one line, no traceback
        raise ShardError(f"bad option: {exc}") from None
    freeze_startup_heap()  # modules loaded: full collections under load walk only what came since (shard.heap)
    trio.run(run_node, config)
    return 0


# Each entry adds one subcommand's parser, whose `run` default is the function that runs it.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_prepare, add_join]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="A shard node: hosts a slice of a model's layers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit status: 0 ok, 1 a ShardError (one line, no traceback),
    2 a usage error (argparse), 130 interrupted."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ShardError, BaseExceptionGroup) as caught:
        e = sole_error(caught)
        if not isinstance(e, ShardError):
            raise
        one_line = " ".join(str(e).split())
        print(f"{PROG} {args.command}: error: {one_line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
