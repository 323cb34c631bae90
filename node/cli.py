"""Shared command-line handling of the node servers: flags -> Settings -> uvicorn.

Flags override the node's environment (`PREFILL_*`, `DECODE_*`). The `kv` section's flags are generated from
KVTransferSettings, one `--kv-<field>` each (`--kv-ucx-tls tcp`, `--kv-timeout-s 10`, `--no-kv-capture-telemetry`).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from pydantic import ValidationError

from engine.kernels import REQUESTS, cli_help
from kv_transfer.ucx_env import KVTransferSettings

SECTION_SEP = "."
"""Flag destinations of a nested section are `<section>.<field>` (`kv.ucx_tls`)."""


def add_kv_flags(parser: argparse.ArgumentParser) -> None:
    """One `--kv-<field>` flag per KVTransferSettings field (validated by the settings, not argparse)."""
    group = parser.add_argument_group("KV transfer (env <PREFIX>KV__<FIELD>)")
    for name, field in KVTransferSettings.model_fields.items():
        flag, dest = f"--kv-{name.replace('_', '-')}", f"kv{SECTION_SEP}{name}"
        help_text = (field.description or "").split(". ")[0]
        if field.annotation is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, dest=dest, metavar=name.upper(), help=help_text)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a preset (default kimi-k3.1-mini), a ModelConfig .json file or a checkpoint "
                        "directory (config.json, safetensors, tokenizer files)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (also the KV side channel)")
    parser.add_argument("--advertise-host", help="host peers use to reach this node (default --host)")
    parser.add_argument("--engine-id", help="engine id (default: random per start)")
    parser.add_argument("--num-rows", type=int, help="packed rows per rank pool")
    parser.add_argument("--block-size", type=int, help="tokens per attention row (power of two)")
    parser.add_argument("--max-context", type=int, help="longest prompt + output")
    parser.add_argument("--max-num-seqs", type=int, help="most requests in one batch")
    parser.add_argument("--seed", type=int, help="reference weights seed (all nodes must agree)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse cached KV blocks of earlier prompts and turns (default on; docs/SESSIONS.md)")
    parser.add_argument("--max-step-tokens", type=int,
                        help="chunked prefill: tokens per engine step, decodes first (default: whole prompts)")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="cpu (default) or cuda: rank r on the node's GPU r, row pool in VRAM, NCCL group")
    parser.add_argument("--kernels", choices=list(REQUESTS), help=cli_help())
    parser.add_argument("--metrics-port", type=int, help="serve GET /metrics on this port too (for monitoring)")
    parser.add_argument("--cluster-secret-file", help="file holding the cluster secret that signs hand-offs "
                        "(the secret itself only by environment, never a flag: it would show in ps)")
    parser.add_argument("--insecure-handoffs", action="store_true", default=None,
                        help="no cluster secret: answer / accept unsigned hand-offs (tests only)")
    parser.add_argument("--drain-s", type=float, help="on SIGTERM, how long in-flight requests may finish")
    parser.add_argument("--drain-hand-off-s", type=float,
                        help="on SIGTERM, end requests still running after this long with a 503 naming the drain "
                             "(our router moves them to another instance)")
    parser.add_argument("--log-level", default="warning")
    add_kv_flags(parser)


def settings_fields(args: dict[str, Any], renames: dict[str, str] | None = None) -> dict[str, Any]:
    """Parsed flags (None: not given) -> Settings keyword arguments, `kv.x` flags nested under `kv`."""
    fields: dict[str, Any] = {}
    for key, value in args.items():
        if value is None:
            continue
        section, sep, name = key.partition(SECTION_SEP)
        if sep:
            fields.setdefault(section, {})[name] = value
        else:
            fields[(renames or {}).get(key, key)] = value
    return fields


def run(argv: list[str], parser: argparse.ArgumentParser, settings_cls: type, create_app: Callable[[Any], Any],
        renames: dict[str, str] | None = None) -> int:
    args = vars(parser.parse_args(argv))
    log_level = args.pop("log_level")
    from node.serving import serve

    try:  # a setting the node cannot start with (an unknown model, no cluster secret, ...)
        settings = settings_cls(**settings_fields(args, renames))
        app = create_app(settings)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors())
        parser.exit(2, f"{parser.prog}: {problems}\n")
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    serve(app, settings, log_level)
    return 0
