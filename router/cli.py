"""`pdcluster router`: start the OpenAI-compatible PD router.

    pdcluster router --config router.yaml [--port 8000] [--host 0.0.0.0]
    pdcluster router --prefill http://p0:8000 [URL...] --decode http://d0:8000 [URL...] [--engine vllm]
    pdcluster router ... --workers N    (default: the cores this process may use; see router/workers.py)

Every other knob comes from ROUTER_* environment variables or the config file's `router:` section
(see router/settings.py).
"""

from __future__ import annotations

import argparse
import os


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file: pools, instances, kubernetes discovery, router settings")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instance URLs")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instance URLs")
    parser.add_argument("--engine", choices=["vllm", "reference"], help="engine of the --prefill/--decode nodes")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument("--admin-token", help="bearer token for the admin endpoints")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes (default: ROUTER_WORKERS, else the cores available)")
    parser.add_argument("--log-level", default="info")
    return parser


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.config and not args.decode:
        print("pdcluster router: give --config FILE or at least one --decode URL")
        return 2
    from router.settings import Settings  # noqa: PLC0415
    from router.workers import serve  # noqa: PLC0415

    overrides = {key: value for key, value in {
        "config_file": args.config, "prefill_urls": args.prefill or None, "decode_urls": args.decode or None,
        "engine": args.engine, "host": args.host, "port": args.port, "admin_token": args.admin_token,
        "workers": args.workers,
    }.items() if value is not None}
    settings = Settings(**overrides)
    if "workers" not in settings.model_fields_set:
        settings = settings.model_copy(update={"workers": available_cores()})
    if settings.workers < 1:
        print(f"pdcluster router: --workers must be at least 1, got {settings.workers}")
        return 2
    serve(settings, args.log_level)
    return 0
