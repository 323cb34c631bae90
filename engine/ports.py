"""Picking TCP ports for servers that bind later (node processes, rank-group stores).

`free_port()` returns a port below the kernel's ephemeral range that nothing listens on now. A process bound
to a port from the ephemeral range seconds after it was picked (a node binds after its ranks started; a rank
group's store after torch imported) can lose it to any outgoing connection or listener on the machine (health
checks, gloo, UCX): seen as "address already in use" at cluster start-up. Below that range only explicit binds
compete, and picks are random, so concurrent pickers rarely collide.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 10_000
"""Picked ports lie in [LOWEST_PORT, start of the ephemeral range)."""


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def is_port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", taken: set[int] | None = None, span: int = 1) -> int:
    """A port on `host` with `span` consecutive free ports from it, none of them in `taken` (which is updated)."""
    taken = taken if taken is not None else set()
    lo, _ = ephemeral_port_range()
    rng = random.Random()
    for _ in range(500):
        if lo - span > LOWEST_PORT:
            base = rng.randrange(LOWEST_PORT, lo - span)
        else:  # no room below the ephemeral range: ask the kernel
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                base = sock.getsockname()[1]
        candidates = range(base, base + span)
        if base + span <= 65535 and not taken.intersection(candidates) and all(is_port_free(host, p) for p in candidates):
            taken.update(candidates)
            return base
    raise RuntimeError(f"no {span} consecutive free ports found on {host}")
