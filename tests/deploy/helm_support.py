"""Real helm over the chart: find the binary, lint, render with values files, pick objects out of the output.

helm v4.1.4 comes from scripts/setup/helm.sh (into .tools/bin); a missing helm fails the test with that
hint instead of skipping, because chart tests are a core path in CI.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "deploy" / "helm" / "pdcluster"
EXAMPLE_VALUES = ("values.yaml", "values-gb300-tp8-dcp8.yaml", "values-cpu-dev.yaml")
KUBE_VERSION = "1.35.0"
"""Kubernetes version templates render for and kubernetes-validate checks against (kubectl from the same layer)."""
RELEASE = "pd"
NAMESPACE = "serving"


def helm_binary() -> Path:
    local = REPO_ROOT / ".tools" / "bin" / "helm"
    if local.is_file():
        return local
    found = shutil.which("helm")
    if found is None:
        pytest.fail("helm not found: run scripts/setup/helm.sh (puts helm v4.1.4 into .tools/bin)")
    return Path(found)


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@dataclass(frozen=True)
class PodTemplate:
    """One pod template from a workload: where it came from and its metadata/spec."""

    owner_kind: str
    owner_name: str
    part: str  # "template" (Deployment), "leader" or "worker" (LeaderWorkerSet)
    metadata: dict
    spec: dict

    @property
    def labels(self) -> dict[str, str]:
        return self.metadata.get("labels", {})

    @property
    def container(self) -> dict:
        return self.spec["containers"][0]


@dataclass(frozen=True)
class Rendered:
    """The documents `helm template` printed, parsed."""

    docs: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        matches = [doc for doc in self.of_kind(kind) if doc["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind} {name}, found {[d['metadata']['name'] for d in self.of_kind(kind)]}"
        return matches[0]

    def pod_templates(self) -> Iterator[PodTemplate]:
        for doc in self.docs:
            name = doc["metadata"]["name"]
            if doc["kind"] == "Deployment":
                tpl = doc["spec"]["template"]
                yield PodTemplate("Deployment", name, "template", tpl["metadata"], tpl["spec"])
            elif doc["kind"] == "LeaderWorkerSet":
                lwt = doc["spec"]["leaderWorkerTemplate"]
                yield PodTemplate("LeaderWorkerSet", name, "leader", lwt["leaderTemplate"]["metadata"],
                                  lwt["leaderTemplate"]["spec"])
                yield PodTemplate("LeaderWorkerSet", name, "worker", lwt["workerTemplate"]["metadata"],
                                  lwt["workerTemplate"]["spec"])

    def pool_pods(self, pool: str) -> list[PodTemplate]:
        return [pod for pod in self.pod_templates() if pod.labels.get("pdcluster.io/pool") == pool]


def render(*values: Path | str, overrides: dict | None = None, tmp_dir: Path | None = None) -> Rendered:
    """`helm template` with the given values files (names relative to the chart) and an optional override dict."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for value in values:
        path = Path(value)
        args += ["-f", str(path if path.is_absolute() else CHART / path)]
    if overrides is not None:
        assert tmp_dir is not None, "overrides need a tmp_dir for their values file"
        extra = tmp_dir / "overrides.yaml"
        extra.write_text(yaml.safe_dump(overrides))
        args += ["-f", str(extra)]
    out = run_helm(*args).stdout
    return Rendered(tuple(doc for doc in yaml.safe_load_all(out) if doc))


def render_error(values_file: Path) -> str:
    """Render with a (bad) values file; return helm's error text, failing if helm accepted it."""
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values_file),
                    check=False)
    assert proc.returncode != 0, f"helm accepted {values_file.name}:\n{values_file.read_text()}"
    return proc.stderr


def arg_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in an argv list (None when the flag is absent)."""
    if flag not in args:
        return None
    index = args.index(flag)
    assert index + 1 < len(args), f"{flag} has no value in {args}"
    return args[index + 1]
