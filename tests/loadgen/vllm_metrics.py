"""Run under the vLLM venv (`.venv-vllm/bin/python tests/loadgen/vllm_metrics.py`): vLLM's own
`calculate_metrics` (vllm/benchmarks/serve.py) over request outputs given as JSON, its metrics printed back
as JSON. This is the oracle for loadgen's metric definitions (tests/loadgen/test_metrics.py); vLLM is called,
never copied.

stdin:  {"cases": [{"outputs": [{RequestFuncOutput field: value}], "dur_s": s, "percentiles": [50.0, ...],
                    "goodput": {"ttft": ms, "tpot": ms, "e2el": ms}}]}
stdout: {"vllm_version": "...", "metrics": [BenchmarkMetrics as a mapping]} (percentiles as [p, value] pairs)
Imports nothing from this project: the vLLM venv does not have it installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys


def main() -> int:
    import vllm
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    request = json.load(sys.stdin)
    metrics = []
    with contextlib.redirect_stdout(sys.stderr):  # calculate_metrics may print; stdout carries only the answer
        for case in request["cases"]:
            outputs = [RequestFuncOutput(**fields) for fields in case["outputs"]]
            result, _ = calculate_metrics(input_requests=[], outputs=outputs, dur_s=case["dur_s"], tokenizer=None,
                                          selected_percentiles=case["percentiles"],
                                          goodput_config_dict=case["goodput"])
            metrics.append(dataclasses.asdict(result))
    json.dump({"vllm_version": vllm.__version__, "metrics": metrics}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
