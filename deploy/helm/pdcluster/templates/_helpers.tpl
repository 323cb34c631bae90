{{/* Names, labels and the resolved view of one pool. */}}

{{- define "pdcluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdcluster.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "pdcluster.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pdcluster.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdcluster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdcluster.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdcluster.selectorLabels" . }}
app.kubernetes.io/part-of: pdcluster
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdcluster.routerName" -}}
{{- printf "%s-router" (include "pdcluster.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Router worker processes: router.workers, else the router's CPU request rounded up (250m -> 1, "2" -> 2). */}}
{{- define "pdcluster.routerWorkers" -}}
{{- $r := .Values.router -}}
{{- if $r.workers -}}
{{- $r.workers | int -}}
{{- else -}}
{{- $cpu := toString (dig "requests" "cpu" "1" ($r.resources | default dict)) -}}
{{- if hasSuffix "m" $cpu -}}
{{- max 1 (divf (trimSuffix "m" $cpu | float64) 1000 | ceil | int) -}}
{{- else -}}
{{- max 1 ($cpu | float64 | ceil | int) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.nodeServiceAccount" -}}
{{- printf "%s-node" (include "pdcluster.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdcluster.computeDomainName" -}}
{{- printf "%s-nvlink" (include "pdcluster.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdcluster.computeDomainClaim" -}}
{{- printf "%s-nvlink-channel" (include "pdcluster.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
pdcluster.pool: one pool with defaults applied and checked, as YAML (use with fromYaml).
Input: dict "root" $ "pool" <pool values>.
*/}}
{{- define "pdcluster.pool" -}}
{{- $root := .root -}}
{{- $p := .pool -}}
{{- $d := $root.Values.poolDefaults -}}
{{- $engine := $p.engine | default "reference" -}}
{{- $tp := int ($p.tp | default 1) -}}
{{- $dcp := int ($p.dcp | default 1) -}}
{{- $world := max $tp $dcp | int -}}
{{- $nodes := int ($p.nodesPerInstance | default 1) -}}
{{- if ne (mod $world $nodes) 0 -}}
{{- fail (printf "pool %s: max(tp, dcp) = %d is not divisible by nodesPerInstance = %d" $p.name $world $nodes) -}}
{{- end -}}
{{- $gpusPerPod := div $world $nodes | int -}}
{{- if and $root.Values.gpu.enabled (gt $gpusPerPod (int $root.Values.gpu.perNode)) -}}
{{- fail (printf "pool %s: %d GPUs per pod exceed gpu.perNode = %d; raise nodesPerInstance" $p.name $gpusPerPod (int $root.Values.gpu.perNode)) -}}
{{- end -}}
{{- if and (eq $p.role "prefill") (gt $dcp 1) -}}
{{- fail (printf "prefill pool %s: dcp must be 1 (prefill is token-sharded over its TP group), got %d" $p.name $dcp) -}}
{{- end -}}
{{- if eq $engine "vllm" -}}
{{- if $p.settings -}}
{{- fail (printf "pool %s: settings apply to reference-engine nodes; a vllm pool takes extraArgs and env" $p.name) -}}
{{- end -}}
{{- if ne (mod $tp $dcp) 0 -}}
{{- fail (printf "pool %s: vLLM needs tp divisible by dcp, got tp=%d dcp=%d" $p.name $tp $dcp) -}}
{{- end -}}
{{- else -}}
{{- if and (gt $tp 1) (gt $dcp 1) -}}
{{- fail (printf "pool %s: the reference engine runs TP or DCP, not both (tp=%d, dcp=%d)" $p.name $tp $dcp) -}}
{{- end -}}
{{- if gt $nodes 1 -}}
{{- fail (printf "pool %s: the reference engine runs one instance on one node (nodesPerInstance=%d)" $p.name $nodes) -}}
{{- end -}}
{{- if and (eq ($root.Values.referenceDevice | default "cpu") "cuda") (not $root.Values.gpu.enabled) -}}
{{- fail (printf "pool %s: referenceDevice cuda needs gpu.enabled (one GPU per rank)" $p.name) -}}
{{- end -}}
{{- end -}}
{{- $img := $root.Values.images.pdcluster -}}
{{- if eq $engine "vllm" -}}{{- $img = $root.Values.images.vllm -}}{{- end -}}
{{- $img = merge (deepCopy ($p.image | default dict)) $img -}}
name: {{ $p.name }}
fullName: {{ printf "%s-%s" (include "pdcluster.fullname" $root) $p.name | trunc 63 | trimSuffix "-" }}
role: {{ $p.role }}
replicas: {{ $p.replicas | default 1 | int }}
tp: {{ $tp }}
dcp: {{ $dcp }}
worldSize: {{ $world }}
engine: {{ $engine }}
model: {{ $p.model | default $root.Values.servedModelName | quote }}
nodesPerInstance: {{ $nodes }}
gpusPerPod: {{ $gpusPerPod }}
multiNode: {{ gt $nodes 1 }}
port: {{ $p.port | default $d.port | int }}
image: {{- toYaml $img | nindent 2 }}
resources: {{- toYaml ($p.resources | default $d.resources) | nindent 2 }}
nodeSelector: {{- toYaml ($p.nodeSelector | default $d.nodeSelector) | nindent 2 }}
tolerations: {{- toYaml ($p.tolerations | default $d.tolerations) | nindent 2 }}
env: {{- toYaml (concat ($d.env | default list) ($p.env | default list)) | nindent 2 }}
extraArgs: {{- toYaml ($p.extraArgs | default list) | nindent 2 }}
settings: {{- toYaml ($p.settings | default dict) | nindent 2 }}
{{- if hasKey ($p.settings | default dict) "http_head_timeout_s" }}
{{- fail (printf "pool %s: settings.http_head_timeout_s: set the pool's httpHeadTimeoutS instead" $p.name) }}
{{- end }}
{{- $head := $p.httpHeadTimeoutS | default $d.httpHeadTimeoutS }}
{{- if and (eq $engine "vllm") (hasKey $p "httpHeadTimeoutS") }}
{{- fail (printf "pool %s: httpHeadTimeoutS applies to reference-engine nodes; set vLLM's flags in extraArgs" $p.name) }}
{{- end }}
httpHeadTimeoutS: {{ $head }}
{{- $grace := int ($p.terminationGracePeriodSeconds | default $d.terminationGracePeriodSeconds) }}
{{- if lt $grace 10 }}
{{- fail (printf "pool %s: terminationGracePeriodSeconds must be at least 10 (the node drains for it minus 5 s), got %d" $p.name $grace) }}
{{- end }}
{{- if hasKey ($p.settings | default dict) "drain_s" }}
{{- if ge (float64 $p.settings.drain_s) (float64 (sub $grace 3)) }}
{{- fail (printf "pool %s: settings.drain_s %v leaves no time in the %d s grace period (preStop pause 3 s)" $p.name $p.settings.drain_s $grace) }}
{{- end }}
{{- end }}
terminationGracePeriodSeconds: {{ $grace }}
{{- /* Never root, RDMA included: IPC_LOCK comes from the container's capabilities (values.yaml says how). */}}
podSecurityContext: {{- toYaml ($p.podSecurityContext | default $d.podSecurityContext) | nindent 2 }}
{{- with $p.maxContextTokens }}
maxContextTokens: {{ int . }}
{{- end }}
{{- end -}}

{{/* Labels of a pool's pods (and its objects). Input: dict "root" $ "p" <resolved pool>. */}}
{{- define "pdcluster.poolLabels" -}}
{{ include "pdcluster.selectorLabels" .root }}
app.kubernetes.io/component: node
pdcluster.io/pool: {{ .p.name }}
{{- end -}}

{{/* Discovery labels: only on pods that serve HTTP (Deployment pods, LWS leaders). */}}
{{- define "pdcluster.discoveryLabels" -}}
app.kubernetes.io/part-of: pdcluster
pdcluster.io/serving: "true"
pdcluster.io/role: {{ .p.role }}
{{- /* the TP group width, DCP ranks included (vLLM's --tensor-parallel-size; a reference DCP pool's ranks) */}}
pdcluster.io/tp: {{ .p.worldSize | quote }}
pdcluster.io/dcp: {{ .p.dcp | quote }}
pdcluster.io/engine: {{ .p.engine }}
{{- end -}}

{{/* The router's discovery selector: serving node pods of this release. */}}
{{- define "pdcluster.discoverySelector" -}}
app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/component=node,pdcluster.io/serving=true
{{- end -}}

{{/* The Secret holding the cluster secret (cluster-secret.yaml, or the operator's). */}}
{{- define "pdcluster.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdcluster.fullname" .) | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{/*
The cluster secret's value (base64), read once per render: the release's Secret as the cluster holds it (kept
across upgrades, or the operator's `existingSecret`), else a fresh random key for a Secret the chart creates.
*/}}
{{- define "pdcluster.clusterSecretB64" -}}
{{- if not (hasKey .Values "__clusterSecretB64") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "pdcluster.clusterSecretName" .) -}}
{{- $value := "" -}}
{{- if $existing -}}
{{- $value = index ($existing.data | default dict) .Values.clusterSecret.key | default "" -}}
{{- end -}}
{{- if and (not $value) (not .Values.clusterSecret.existingSecret) -}}
{{- $value = randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- $_ := set .Values "__clusterSecretB64" $value -}}
{{- end -}}
{{- .Values.__clusterSecretB64 -}}
{{- end -}}

{{/* Pod annotation: a rotated cluster secret (or a bumped `clusterSecret.revision`) restarts the pods. */}}
{{- define "pdcluster.clusterSecretChecksum" -}}
checksum/cluster-secret: {{ printf "%s/%s" (include "pdcluster.clusterSecretB64" .) .Values.clusterSecret.revision | sha256sum | quote }}
{{- end -}}

{{/* Where the cluster secret is mounted, and the file's path (its key). */}}
{{- define "pdcluster.clusterSecretDir" -}}/var/run/pdcluster/cluster-secret{{- end -}}
{{- define "pdcluster.clusterSecretFile" -}}{{ include "pdcluster.clusterSecretDir" . }}/{{ .Values.clusterSecret.key }}{{- end -}}

{{/* The volume of the cluster secret: read-only, group-readable for the pod's fsGroup, nothing else in it. */}}
{{- define "pdcluster.clusterSecretVolume" -}}
- name: cluster-secret
  secret:
    secretName: {{ include "pdcluster.clusterSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.clusterSecret.key }}
        path: {{ .Values.clusterSecret.key }}
{{- end -}}
