"""The router's app under a kept HTTP server (uvicorn on httptools + uvloop, or granian): benchmarks/router.py's
`uvicorn` and `granian` contenders, measured against `pdcluster` (router/server.py, what `pdcluster router` runs).

    PYTHONPATH=TREE python benchmarks/router_asgi.py --server uvicorn|granian --prefill URL --decode URL \
        --port PORT [--workers N]

`TREE` must hold a router whose app serves the completion routes as ASGI: router/fastpath.py, which
benchmarks/router.py checks out with `--asgi-rev` (the last revision that had it; `pdcluster router` has served
only through router/server.py since). Each worker builds the app as `pdcluster router` does: `create_app` from the
ROUTER_* settings, then the frozen heap and young-generation GC threshold of router/workers.py. The server's own
supervisor runs the workers (uvicorn: a shared socket; granian: its Rust acceptor); they share no state (drains,
merged metrics), which nothing in the benchmark reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

GC_GEN0_THRESHOLD = 20_000
"""router/workers.py's (kept here: the checked-out tree may predate it)."""


def app():
    """The ASGI factory each worker calls."""
    from router.app import create_app  # noqa: PLC0415
    from router.settings import Settings  # noqa: PLC0415

    application = create_app(Settings())
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    return application


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["uvicorn", "granian"], required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    os.environ.update({"ROUTER_PREFILL_URLS": json.dumps([args.prefill]),
                       "ROUTER_DECODE_URLS": json.dumps([args.decode]), "ROUTER_ENGINE": "vllm"})
    here = str(Path(__file__).resolve().parent)  # last: benchmarks/router.py must not shadow the `router` package
    sys.path[:] = [p for p in sys.path if p != here] + [here]  # the workers import this file as `router_asgi`
    if args.server == "uvicorn":
        import uvicorn  # noqa: PLC0415

        uvicorn.run("router_asgi:app", factory=True, host="127.0.0.1", port=args.port, workers=args.workers,
                    http="httptools", loop="uvloop", lifespan="on", log_level="warning", access_log=False,
                    backlog=2048)
    else:
        from granian import Granian  # noqa: PLC0415

        Granian("router_asgi:app", factory=True, address="127.0.0.1", port=args.port, interface="asgi",
                workers=args.workers, loop="uvloop", http="1", websockets=False, backlog=2048,
                log_level="warning").serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
