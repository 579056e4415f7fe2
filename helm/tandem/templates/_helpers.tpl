{{/* Names, labels, images: one place for what every template uses. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>": the name of a component's workload and Service. Call with (list $ "target"). */}}
{{- define "tandem.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "tandem.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) }}
{{- end }}

{{/* Selector labels of one component. Call with (list $ "target"). */}}
{{- define "tandem.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "tandem.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* All labels of one component's objects. Call with (list $ "target"). */}}
{{- define "tandem.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}

{{/* repository:tag[@digest]; the tag defaults to the chart's appVersion. Call with (list $ .Values.images.worker). */}}
{{- define "tandem.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- $tag := default $root.Chart.AppVersion $image.tag }}
{{- if $image.digest }}
{{- printf "%s:%s@%s" $image.repository $tag $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository $tag }}
{{- end }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.componentName" (list . "coordinator")) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Redis URL the coordinator gets, or "" for its in-process cache. */}}
{{- define "tandem.redisUrl" -}}
{{- if and .Values.redis.url .Values.redis.bundled.enabled }}
{{- fail "redis: set redis.url (an external Redis) or redis.bundled.enabled, not both" }}
{{- end }}
{{- if .Values.redis.bundled.enabled }}
{{- printf "redis://%s:%d/0" (include "tandem.componentName" (list . "redis")) (int .Values.redis.bundled.port) }}
{{- else }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{/* The Deployment's replicas line, left out while an autoscaler owns the count. Call with (list $ .Values.target $kedaScales). */}}
{{- define "tandem.replicas" -}}
{{- $values := index . 1 }}
{{- if not (or $values.autoscaling.enabled (index . 2)) }}
replicas: {{ $values.replicas }}
{{- end }}
{{- end }}

{{/* Does KEDA scale this fleet? Call with (list $ "target"); prints "true" or nothing. */}}
{{- define "tandem.kedaScales" -}}
{{- $root := index . 0 }}
{{- if and $root.Values.autoscaling.keda.enabled (ne (index . 1) "coordinator") }}true{{ end }}
{{- end }}

{{/* Pod-level security and scheduling shared by every pod. Call with (list $ .Values.target). */}}
{{- define "tandem.podScheduling" -}}
{{- $root := index . 0 }}
{{- $values := index . 1 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The model volume (pvc, hostPath, or an emptyDir the download init container fills). */}}
{{- define "tandem.modelVolume" -}}
- name: models
{{- if eq .Values.models.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.pvc.claimName }}
    readOnly: {{ .Values.models.readOnly }}
{{- else if eq .Values.models.source "hostPath" }}
  hostPath:
    path: {{ .Values.models.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.models.download.sizeLimit }}
{{- end }}
{{- end }}

{{- define "tandem.modelMount" -}}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  {{- /* A downloaded model sits in the pod's own emptyDir, written by its init container. */}}
  readOnly: {{ and .Values.models.readOnly (ne .Values.models.source "download") }}
{{- end }}

{{/* Environment every Tandem container gets: the model cache root inside the model volume. */}}
{{- define "tandem.commonEnv" -}}
- name: TANDEM_HOME
  value: {{ printf "%s/.tandem" .Values.models.mountPath | quote }}
{{- end }}

{{/* --otlp-traces-endpoint for every Tandem server, when tracing.otlpEndpoint is set. */}}
{{- define "tandem.tracingArgs" -}}
{{- with .Values.tracing.otlpEndpoint }}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
With tracing on: resource attributes that say which pod a span came from. Tandem names the service
itself (tandem-coordinator, tandem-target, tandem-draft); the SDK reads OTEL_RESOURCE_ATTRIBUTES and
Kubernetes expands $(TANDEM_POD_NAME) from the variable defined before it.
*/}}
{{- define "tandem.tracingEnv" -}}
{{- if .Values.tracing.otlpEndpoint }}
- name: TANDEM_POD_NAME
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(TANDEM_POD_NAME),service.namespace=%s" .Release.Namespace (include "tandem.fullname" .) | quote }}
{{- end }}
{{- end }}

{{/*
The hub download init container (models.source: download), in the pod's own image (both have `hf`).
Call with (list $ .Values.models.target "target" $tokenizerOnly .Values.images.worker).
The coordinator needs only the target's tokenizer and config, not its weights: it downloads those
files and adds an empty placeholder weights file, because `--tokenizer` accepts only a complete
model directory (config.json and *.safetensors) and reads nothing but the tokenizer from it.
(Chat templates may come as a file of their own, chat_template.jinja: it is a tokenizer file.)
A worker downloads what it loads, not the rest of the repository: many ship the weights twice
(PyTorch .bin or .pth files, GGUF files, an original/ folder), which filled the volume's sizeLimit.
Heads are downloaded whole: their formats include .pt and .bin files (tandem/heads/formats).
*/}}
{{- define "tandem.downloadInitContainer" -}}
{{- $root := index . 0 }}
{{- $model := index . 1 }}
{{- $tokenizerOnly := index . 3 }}
{{- $image := index . 4 }}
{{- $dir := printf "%s/%s" $root.Values.models.mountPath $model.dir }}
- name: download-{{ index . 2 }}-model
  image: {{ include "tandem.image" (list $root $image) }}
  imagePullPolicy: {{ $image.pullPolicy }}
  command: [sh, -c]
  args:
    - >-
      hf download "$MODEL_REPO" --revision "$MODEL_REVISION" --local-dir "$MODEL_DIR"
      {{- if $tokenizerOnly }}
      --include '*.json' --include '*.txt' --include '*.model' --include '*.tiktoken' --include '*.jinja'
      && touch "$MODEL_DIR/tokenizer-only-placeholder.safetensors"
      {{- else if has (index . 2) (list "target" "draft") }}
      --include '*.safetensors' --include '*.json' --include '*.txt' --include '*.model' --include '*.tiktoken'
      --include '*.jinja'
      {{- end }}
  env:
    - {name: MODEL_REPO, value: {{ $model.repo | quote }}}
    - {name: MODEL_REVISION, value: {{ $model.revision | quote }}}
    - {name: MODEL_DIR, value: {{ $dir | quote }}}
    - {name: HF_HOME, value: {{ printf "%s/.hf" $root.Values.models.mountPath | quote }}}
    # One download per pod: Xet's chunk cache (10 GB by default, under HF_HOME) would only fill the volume.
    - {name: HF_XET_CHUNK_CACHE_SIZE_BYTES, value: "0"}
    {{- with $root.Values.models.download.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $root.Values.models.download.tokenSecret.key }}}
    {{- end }}
  resources:
    {{- toYaml $root.Values.models.download.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: {{ $root.Values.models.mountPath }}}
    - {name: tmp, mountPath: /tmp}
{{- end }}

{{/* TLS flags of a server (coordinator or worker). Call with (list $ $isWorker). */}}
{{- define "tandem.serverTlsArgs" -}}
{{- $root := index . 0 }}
{{- if $root.Values.tls.enabled }}
- --tls-cert
- /etc/tandem/tls/tls.crt
- --tls-key
- /etc/tandem/tls/tls.key
{{- if and $root.Values.tls.mutual (index . 1) }}
- --tls-client-ca
- /etc/tandem/tls/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "tandem.tlsMount" -}}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /etc/tandem/tls, readOnly: true}
{{- end }}
{{- end }}

{{/*
Startup, readiness and liveness probes on grpc.health.v1 (service ""), which reports SERVING only
once weights are loaded and warmed up. Native gRPC probes speak plaintext only; with TLS on, an
exec probe makes the same Check over TLS from inside the container. Call with (list $ .Values.target .Values.target.port).
*/}}
{{- define "tandem.probes" -}}
{{- $root := index . 0 }}
{{- $values := index . 1 }}
{{- $port := index . 2 }}
{{- $httpReady := and (gt (len .) 3) (index . 3) }}{{/* the coordinator's readiness from its HTTP API's /health */}}
{{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{- $probe := index $values $kind }}
{{ $kind }}:
  {{- if and $httpReady (eq $kind "readinessProbe") }}
  httpGet:
    path: /health
    port: http
    scheme: {{ ternary "HTTPS" "HTTP" $root.Values.tls.enabled }}
  {{- else if $root.Values.tls.enabled }}
  exec:
    command:
      - python
      - -c
      - {{ include "tandem.tlsHealthCheck" $root | quote }}
      - /etc/tandem/tls
      - {{ $port | quote }}
      - {{ $root.Values.tls.serverName | quote }}
      - {{ ternary "mutual" "server-only" $root.Values.tls.mutual | quote }}
  {{- else }}
  grpc:
    port: {{ $port }}
  {{- end }}
  periodSeconds: {{ $probe.periodSeconds }}
  failureThreshold: {{ $probe.failureThreshold }}
  timeoutSeconds: 5
{{- end }}
{{- end }}

{{/* The exec probe's program: argv = TLS directory, port, expected server name, "mutual" or not. Exits 0 only on SERVING. */}}
{{- define "tandem.tlsHealthCheck" -}}
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
tls_dir, port, name, mode = sys.argv[1:5]
read = lambda f: open(tls_dir + "/" + f, "rb").read()
mutual = mode == "mutual"
creds = grpc.ssl_channel_credentials(read("ca.crt"), read("tls.key") if mutual else None, read("tls.crt") if mutual else None)
channel = grpc.secure_channel("127.0.0.1:" + port, creds, options=[("grpc.ssl_target_name_override", name)])
reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=4)
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
{{- end }}
