"""Stand up the namespace test bed (tests/netbed.py) by hand: public hosts on a bridge with
shaped uploads, and homes behind a MASQUERADE router; print how to run a process on each,
then hold it until Ctrl-C (every namespace is deleted on the way out). Needs root.

  sudo .venv/bin/python scripts/netbed.py --public coord,n1,n2 --upload-mbit 50 --home home1:h1 \
      --symmetric-home home2:h2
  # then, e.g.:  ip netns exec <ns of coord> shard-coord serve --http 0.0.0.0:8000 ...
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.netbed import Netbed, NetbedError  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--public", default="coord,n1,n2", help="comma-separated public host names")
    p.add_argument("--home", action="append", default=[],
                   help="ROUTER:HOST[,HOST...] a home behind a port-keeping NAT: hole punching works (repeatable)")
    p.add_argument("--symmetric-home", action="append", default=[],
                   help="ROUTER:HOST[,HOST...] a home behind a NAT that picks random ports: relayed only (repeatable)")
    p.add_argument("--upload-mbit", type=float, default=None, help="tbf upload shaping of every public host")
    args = p.parse_args()
    try:
        with Netbed() as bed:
            for name in filter(None, args.public.split(",")):
                bed.add_public(name, args.upload_mbit)
            for spec, symmetric in [(h, False) for h in args.home] + [(h, True) for h in args.symmetric_home]:
                router, _, hosts = spec.partition(":")
                bed.add_home(router, hosts.split(","), args.upload_mbit, symmetric=symmetric)
            for h in bed.hosts.values():
                print(f"{h.name:10} {h.ip:15} (seen as {h.public_ip:15})  {' '.join(h.prefix)}", flush=True)
            print("Ctrl-C to tear it down.", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except NetbedError as exc:
        print(f"netbed: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
