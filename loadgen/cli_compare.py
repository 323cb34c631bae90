"""`pdcluster loadgen compare A.json B.json`: print the side-by-side table (see compare.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadgen.compare import compare_table
from loadgen.summary import load_summary


def main_compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdcluster loadgen compare", description="compare two summary.json files")
    p.add_argument("a", type=Path, help="baseline summary.json (or its directory)")
    p.add_argument("b", type=Path, help="summary.json to compare against the baseline")
    args = p.parse_args(argv)
    paths = [x / "summary.json" if x.is_dir() else x for x in (args.a, args.b)]
    try:
        a, b = (load_summary(x) for x in paths)
    except ValueError as exc:
        print(f"pdcluster loadgen compare: error: {exc}", file=sys.stderr)
        return 2
    print(compare_table(a, b, str(paths[0]), str(paths[1])))
    return 0
