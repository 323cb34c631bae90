"""The `pdcluster` console script: one dispatcher, one module per subcommand.

Each subcommand lives in its own package's `cli` module and exposes `main(argv: list[str]) -> int`.
Modules are imported only when their subcommand runs, so `pdcluster router` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.cli", "run the reference engine on one prompt (the numerical oracle)"),
    "plan": ("sim.plan_cli", "KV capacity of one instance; with --workload, a cluster plan searched by simulation"),
    "prefill": ("prefill_node.cli", "start a prefill node: FastAPI server + W rank processes"),
    "decode": ("decode_node.cli", "start a decode node (TP or DCP pool): FastAPI server + rank processes"),
    "router": ("router.cli", "start the OpenAI-compatible PD router"),
    "up": ("cluster.cli", "start the whole cluster on this machine (router, prefill and decode pools)"),
    "loadgen": ("loadgen.cli", "drive an OpenAI-compatible endpoint with agent/random/trace load"),
    "sim": ("sim.cli", "simulate a cluster under loadgen's workloads (real router/scheduler decisions, profiled times)"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: pdcluster COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`pdcluster COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name in ("-V", "--version"):
        from pdcluster import __version__

        print(__version__)
        return 0
    if name not in COMMANDS:
        print(f"pdcluster: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
