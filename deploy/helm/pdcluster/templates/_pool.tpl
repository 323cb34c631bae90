{{/* Command lines and pod specs of pool pods. Inputs: dict "root" $ "p" <resolved pool> ["worker" bool]. */}}

{{/* vLLM: `vllm serve` with the NIXL connector, TP/DCP sizes and, across nodes, the LWS rendezvous. */}}
{{- define "pdcluster.vllmArgs" -}}
{{- $root := .root -}}{{- $p := .p -}}{{- $v := $root.Values.vllm -}}
{{- $kvRole := ternary "kv_producer" "kv_consumer" (eq $p.role "prefill") -}}
- {{ $p.model | quote }}
- --served-model-name
- {{ $root.Values.servedModelName | quote }}
- --host
- "0.0.0.0"
- --port
- {{ $p.port | quote }}
- --tensor-parallel-size
- {{ $p.tp | quote }}
{{- if gt (int $p.dcp) 1 }}
- --decode-context-parallel-size
- {{ $p.dcp | quote }}
{{- end }}
- --kv-transfer-config
- {{ dict "kv_connector" $v.kvConnector "kv_role" $kvRole | toJson | quote }}
{{- with $v.ttftBuckets }}
- --custom-histogram-buckets
- {{ dict "time_to_first_token" . | toJson | quote }}
{{- end }}
{{- if $p.multiNode }}
- --nnodes
- {{ $p.nodesPerInstance | quote }}
- --node-rank
- {{ ternary "$(LWS_WORKER_INDEX)" "0" (.worker | default false) | quote }}
- --master-addr
- "$(LWS_LEADER_ADDRESS)"
{{- if .worker }}
- --headless
{{- end }}
{{- end }}
{{- range concat ($v.extraArgs | default list) $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Reference engine: `pdcluster prefill|decode` (cluster/plan.py builds the same lines). */}}
{{- define "pdcluster.referenceArgs" -}}
{{- $p := .p -}}
- {{ $p.role }}
- --model
- {{ $p.model | quote }}
{{- if eq (.root.Values.referenceDevice | default "cpu") "cuda" }}
- --device
- "cuda"
{{- end }}
{{- if eq $p.role "prefill" }}
- --tp
- {{ $p.tp | quote }}
{{- else if gt (int $p.dcp) 1 }}
- --dcp
- {{ $p.dcp | quote }}
{{- else }}
- --tp
- {{ $p.tp | quote }}
{{- end }}
- --port
- {{ $p.port | quote }}
- --host
- "0.0.0.0"
{{- if eq $p.role "decode" }}
- --pool
- {{ $p.name }}
{{- end }}
{{- range $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Node settings as the environment the node's Settings read (cluster/plan.py settings_env does the same):
     dict "prefix" "DECODE_" "settings" {kv: {timeout_s: 5}} -> DECODE_KV__TIMEOUT_S=5 (nested: `__`). */}}
{{- define "pdcluster.settingsEnv" -}}
{{- $prefix := .prefix -}}
{{- range $key, $value := .settings -}}
{{- $name := printf "%s%s" $prefix (upper $key) -}}
{{- if kindIs "map" $value -}}
{{- include "pdcluster.settingsEnv" (dict "prefix" (printf "%s__" $name) "settings" $value) -}}
{{- else }}
- name: {{ $name }}
  value: {{ ternary $value (toJson $value) (kindIs "string" $value) | quote }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.poolResources" -}}
{{- $root := .root -}}{{- $p := .p -}}
{{- $res := deepCopy ($p.resources | default dict) -}}
{{- $limits := $res.limits | default dict -}}
{{- if and $root.Values.gpu.enabled (not $root.Values.dra.gpus) -}}
{{- $_ := set $limits $root.Values.gpu.resourceName (int $p.gpusPerPod) -}}
{{- end -}}
{{- if $root.Values.rdma.enabled -}}
{{- $_ := set $limits $root.Values.rdma.resourceName (int $root.Values.rdma.count) -}}
{{- end -}}
{{- if $limits -}}{{- $_ := set $res "limits" $limits -}}{{- end -}}
{{- $claims := list -}}
{{- if $root.Values.computeDomain.enabled -}}{{- $claims = append $claims (dict "name" "nvlink-channel") -}}{{- end -}}
{{- if and $root.Values.gpu.enabled $root.Values.dra.gpus -}}{{- $claims = append $claims (dict "name" "gpus") -}}{{- end -}}
{{- if $claims -}}{{- $_ := set $res "claims" $claims -}}{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "pdcluster.poolAffinity" -}}
{{- $root := .root -}}{{- $p := .p -}}{{- $t := $root.Values.topology -}}
{{- if and $root.Values.gpu.enabled $t.requireClique }}
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
      - matchExpressions:
          - key: {{ $t.cliqueLabel }}
            {{- if $t.cliques }}
            operator: In
            values: {{- toYaml $t.cliques | nindent 14 }}
            {{- else }}
            operator: Exists
            {{- end }}
{{- end }}
{{- if and $p.multiNode $t.sameCliquePerInstance }}
podAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: {{ $t.cliqueLabel }}
      labelSelector:
        matchLabels: {{- include "pdcluster.poolLabels" (dict "root" $root "p" $p) | nindent 10 }}
      matchLabelKeys:
        - leaderworkerset.sigs.k8s.io/group-key
{{- end }}
{{- end -}}

{{- define "pdcluster.poolPodSpec" -}}
{{- $root := .root -}}{{- $p := .p -}}{{- $worker := .worker | default false -}}
serviceAccountName: {{ include "pdcluster.nodeServiceAccount" $root }}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ $p.terminationGracePeriodSeconds }}
{{- with $p.podSecurityContext }}
securityContext: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (include "pdcluster.poolAffinity" .) }}
affinity: {{- . | nindent 2 }}
{{- end }}
containers:
  - name: engine
    image: "{{ $p.image.repository }}:{{ $p.image.tag }}"
    imagePullPolicy: {{ $p.image.pullPolicy | default "IfNotPresent" }}
    {{- if eq $p.engine "vllm" }}
    command: ["vllm", "serve"]
    args: {{- include "pdcluster.vllmArgs" . | nindent 6 }}
    {{- else }}
    command: ["pdcluster"]
    args: {{- include "pdcluster.referenceArgs" . | nindent 6 }}
    {{- end }}
    env:
      {{- if $root.Values.networkPolicy.enabled }}
      # The only ports besides HTTP the NetworkPolicy opens between nodes: UCX listens in this range.
      - name: UCX_TCP_PORT_RANGE
        value: {{ $root.Values.networkPolicy.ucxTcpPortRange | quote }}
      {{- end }}
      - name: POD_IP
        valueFrom: {fieldRef: {fieldPath: status.podIP}}
      - name: POD_NAME
        valueFrom: {fieldRef: {fieldPath: metadata.name}}
      - name: POD_NAMESPACE
        valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
      {{- if eq $p.engine "vllm" }}
      - name: VLLM_NIXL_SIDE_CHANNEL_HOST
        value: "$(POD_IP)"
      - name: VLLM_NIXL_SIDE_CHANNEL_PORT
        value: {{ $root.Values.vllm.sideChannelPort | quote }}
      {{- with $root.Values.vllm.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- else }}
      {{- with $p.settings }}
      {{- include "pdcluster.settingsEnv" (dict "prefix" (printf "%s_" (upper $p.role)) "settings" .) | trim | nindent 6 }}
      {{- end }}
      {{- if not $worker }}
      - name: {{ upper $p.role }}_CLUSTER_SECRET_FILE
        value: {{ include "pdcluster.clusterSecretFile" $root | quote }}
      {{- end }}
      - name: {{ upper $p.role }}_HTTP_HEAD_TIMEOUT_S
        value: {{ $p.httpHeadTimeoutS | quote }}
      {{- if not (hasKey $p.settings "require_reader") }}
      {{- /* the chart's router names the reader of every hand-off (router/readers.py): refuse unbound ones */}}
      - name: {{ upper $p.role }}_REQUIRE_READER
        value: "true"
      {{- end }}
      - name: {{ upper $p.role }}_ADVERTISE_HOST
        value: "$(POD_IP)"
      - name: {{ upper $p.role }}_METRICS_PORT
        value: {{ $root.Values.nodeMetricsPort | quote }}
      {{- if not (hasKey $p.settings "drain_s") }}
      - name: {{ upper $p.role }}_DRAIN_S
        value: {{ sub $p.terminationGracePeriodSeconds 5 | quote }}
      {{- end }}
      {{- end }}
      {{- with $p.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      {{- if not $worker }}
      - name: http
        containerPort: {{ $p.port }}
      {{- end }}
      {{- if and (ne $p.engine "vllm") (not $worker) }}
      - name: metrics
        containerPort: {{ $root.Values.nodeMetricsPort }}
      {{- end }}
      {{- if eq $p.engine "vllm" }}
      - name: nixl-side
        containerPort: {{ $root.Values.vllm.sideChannelPort }}
      {{- end }}
    resources: {{- include "pdcluster.poolResources" . | nindent 6 }}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities:
        drop: ["ALL"]
        {{- if $root.Values.rdma.enabled }}
        add: ["IPC_LOCK"]
        {{- end }}
    # SIGTERM drains a reference node for its drain_s (the grace period minus 5 s, set above); the pause
    # first lets the router and the Service stop sending here before the node answers 503.
    lifecycle:
      preStop:
        exec:
          command: ["sleep", "3"]
    {{- if not $worker }}
    startupProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: {{ $root.Values.poolDefaults.startupProbe.periodSeconds }}
      failureThreshold: {{ $root.Values.poolDefaults.startupProbe.failureThreshold }}
    readinessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 5
      failureThreshold: 3
    livenessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 15
      failureThreshold: 4
    {{- end }}
    volumeMounts:
      - name: dshm
        mountPath: /dev/shm
      {{- if and (ne $p.engine "vllm") (not $worker) }}
      - name: cluster-secret
        mountPath: {{ include "pdcluster.clusterSecretDir" $root }}
        readOnly: true
      {{- end }}
      {{- with $root.Values.poolDefaults.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $root.Values.shm.sizeLimit }}
  {{- if and (ne $p.engine "vllm") (not $worker) }}
  {{- include "pdcluster.clusterSecretVolume" $root | nindent 2 }}
  {{- end }}
  {{- with $root.Values.poolDefaults.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- if or $root.Values.computeDomain.enabled (and $root.Values.gpu.enabled $root.Values.dra.gpus) }}
resourceClaims:
  {{- if $root.Values.computeDomain.enabled }}
  - name: nvlink-channel
    resourceClaimTemplateName: {{ include "pdcluster.computeDomainClaim" $root }}
  {{- end }}
  {{- if and $root.Values.gpu.enabled $root.Values.dra.gpus }}
  - name: gpus
    resourceClaimTemplateName: {{ printf "%s-gpus" $p.fullName | trunc 63 | trimSuffix "-" }}
  {{- end }}
{{- end }}
{{- end -}}
