"""`pdcluster prefill --model PRESET --tp W --port P [--host H]`: a prefill node (FastAPI + W ranks)."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from node.cli import add_common_flags, run
    from prefill_node.app import create_app
    from prefill_node.settings import Settings

    parser = argparse.ArgumentParser(prog="pdcluster prefill", description=__doc__)
    add_common_flags(parser)
    parser.add_argument("--tp", type=int, help="tensor-parallel ranks W (default 1)")
    parser.add_argument("--lease-seconds", type=float, help="how long exported rows wait for a reader")
    parser.add_argument("--token-shard-min-tokens", type=int,
                        help="prefill steps with at least this many tokens use token-sharded attention")
    return run(argv, parser, Settings, create_app)
