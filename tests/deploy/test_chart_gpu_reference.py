"""Reference-engine pools on GPUs in the chart: `referenceDevice: cuda` puts `--device cuda` on every reference
node's command line (the flag `pdcluster up --device cuda` passes), is refused without `gpu.enabled`, and maps to
the cluster config's `device` (cluster/helm.py); the default stays on the CPU."""

from __future__ import annotations

import pytest
import yaml

from cluster.helm import config_from_helm_values
from tests.deploy.helm_support import CHART, arg_value, render, render_error

pytestmark = pytest.mark.process


def _reference_args(rendered) -> dict[str, list[str]]:
    return {pod.owner_name: list(pod.container["args"]) for pod in rendered.pod_templates()
            if pod.container.get("command") == ["pdcluster"] and pod.container["args"][0] in ("prefill", "decode")}


def test_reference_pools_get_device_cuda(tmp_path) -> None:
    args = _reference_args(render("values.yaml", overrides={"referenceDevice": "cuda"}, tmp_dir=tmp_path))
    assert args, "no reference pool rendered"
    for name, argv in args.items():
        assert arg_value(argv, "--device") == "cuda", name


def test_default_reference_pools_stay_on_cpu() -> None:
    args = _reference_args(render("values.yaml"))
    assert args, "no reference pool rendered"
    for name, argv in args.items():
        assert "--device" not in argv, name


def test_cuda_without_gpus_is_refused(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"referenceDevice": "cuda", "gpu": {"enabled": False}}))
    assert "referenceDevice cuda needs gpu.enabled" in render_error(bad)


def test_values_map_to_the_cluster_device() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert config_from_helm_values(values).device == "cpu"
    assert config_from_helm_values({**values, "referenceDevice": "cuda"}).device == "cuda"
