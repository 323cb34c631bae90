"""Shared command-line handling of the node servers: flags -> Settings -> uvicorn."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model preset (default kimi-k3.1-mini)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (also the KV side channel)")
    parser.add_argument("--advertise-host", help="host peers use to reach this node (default --host)")
    parser.add_argument("--engine-id", help="engine id (default: random per start)")
    parser.add_argument("--num-rows", type=int, help="packed rows per rank pool")
    parser.add_argument("--block-size", type=int, help="tokens per attention row (power of two)")
    parser.add_argument("--max-context", type=int, help="longest prompt + output")
    parser.add_argument("--max-num-seqs", type=int, help="most requests in one batch")
    parser.add_argument("--seed", type=int, help="reference weights seed (all nodes must agree)")
    parser.add_argument("--log-level", default="warning")


def run(argv: list[str], parser: argparse.ArgumentParser, settings_cls: type, create_app: Callable[[Any], Any],
        renames: dict[str, str] | None = None) -> int:
    args = vars(parser.parse_args(argv))
    log_level = args.pop("log_level")
    fields = {(renames or {}).get(k, k): v for k, v in args.items() if v is not None}
    settings = settings_cls(**fields)
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                timeout_graceful_shutdown=5)
    return 0
