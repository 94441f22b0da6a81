"""`shard-coord`: the coordinator's command line. Flags derive from CoordConfig."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from shard.heap import bound_kernel_caches, freeze_startup_heap

bound_kernel_caches()  # before anything imports torch

import trio

from coordinator.config import CoordConfig
from coordinator.server import serve_coordinator
from coordinator.errors import CoordinatorError
from shard.errors import ShardError
from shard.options import add_options, config_from_args

PROG = "shard-coord"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="The shard coordinator and OpenAI-compatible gateway.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the coordinator (and, with --local-nodes, a local ring)")
    add_options(serve, CoordConfig)
    serve.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    return parser


def banner(http_port: int, host: str, model: str, *, keys: bool = False) -> str:
    """What `serve` prints once the ring is ready; with `keys` (--api-keys) the examples
    send the key from $SHARD_API_KEY."""
    base = f"http://{host}:{http_port}"
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    auth = ' -H "Authorization: Bearer $SHARD_API_KEY"' if keys else ""
    api_key = "__import__('os').environ['SHARD_API_KEY']" if keys else "'none'"
    first = "API keys are on: export SHARD_API_KEY=<a key from the --api-keys file>, then try:" if keys else "Try:"
    return f"""
shard is serving {model} at {base}/v1 (OpenAI-compatible). {first}

  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Name three colours."}}], "max_tokens": 40}}'

  {python} -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key={api_key}); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Name three colours.'}}], max_tokens=40).choices[0].message.content)"

Status page: {base}/     Metrics: {base}/metrics     Ring as JSON: curl {base}/v1/ring     Stop: Ctrl-C
"""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # flags the configs check (a parser, a range), refused before anything loads
        config = config_from_args(CoordConfig, args)
    except ValueError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            http_port, addr, model_id, key_hex, wait_ring = await nursery.start(serve_coordinator, config)
            freeze_startup_heap()  # serving: full collections under load walk only what came since (shard.heap)
            join_line = f"Volunteers join with: shard-node join --coordinator {addr}\n"
            if not config.local_nodes:  # "serving" only once a request can be served: a ring exists
                print(f"Waiting for {config.first_ring_nodes} node(s) to form a ring. {join_line}", flush=True)
                await wait_ring()
            print(banner(http_port, config.http.rsplit(":", 1)[0], model_id, keys=config.api.api_keys is not None), flush=True)
            if key_hex is not None:
                print(f"Receipts are signed by coordinator key {key_hex} (GET /v1/receipts/key); check a bundle "
                      f"with: shard-receipts verify BUNDLE --coordinator-key {key_hex}", flush=True)
            print(join_line, flush=True)

    try:
        trio.run(run)
    except BaseException as e:  # trio may wrap what ended the run in exception groups
        status, line = exit_of(e, config)
        if line:
            print(f"{PROG} {args.command}: error: {line}", file=sys.stderr)
        return status
    return 0


def exit_of(exc: BaseException, config: CoordConfig) -> tuple[int, str]:
    """(exit status, the one error line or "") for what ended the run; re-raises what is a
    bug (a traceback is then the useful report). Ctrl-C is quiet: the user asked for it."""
    leaves = list(_leaves(exc))
    if any(isinstance(e, KeyboardInterrupt) for e in leaves):
        return 130, ""
    for e in leaves:
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            return 1, (f"{config.http} is in use (another shard-coord, or another server): stop it, "
                       f"or pass --http HOST:PORT with a free port")
        if isinstance(e, (ShardError, CoordinatorError)):
            return 1, " ".join(str(e).split())
        if isinstance(e, OSError):
            return 1, f"{e.strerror or e} ({config.http}): check --http and --listen"
    raise exc


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


if __name__ == "__main__":
    sys.exit(main())
