"""`pdcluster decode --model PRESET (--tp B | --dcp W) --port P [--pool NAME]`: a decode node."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from decode_node.app import create_app
    from decode_node.settings import Settings
    from node.cli import add_common_flags, run

    parser = argparse.ArgumentParser(prog="pdcluster decode", description=__doc__)
    add_common_flags(parser)
    width = parser.add_mutually_exclusive_group()
    width.add_argument("--tp", type=int, help="TP pool of B ranks")
    width.add_argument("--dcp", type=int, help="DCP pool of W ranks (the cache is split by token)")
    parser.add_argument("--pool", help="decode pool name")
    parser.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"))
    return run(argv, parser, Settings, create_app)
