{{/* Names and labels. */}}
{{- define "specgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specgate.fullname" -}}
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

{{- define "specgate.collectorName" -}}
{{- printf "%s-otel-collector" (include "specgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of one component: pass (dict "ctx" $ "component" "gateway"). */}}
{{- define "specgate.labels" -}}
helm.sh/chart: {{ include "specgate.chart" .ctx }}
{{ include "specgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* The labels a component's selectors match on. */}}
{{- define "specgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* An image reference; a digest wins over a tag. Pass (dict "image" .Values.image "default" tag). */}}
{{- define "specgate.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .default .image.tag) }}
{{- end }}
{{- end }}

{{- define "specgate.image" -}}
{{- include "specgate.imageRef" (dict "image" .Values.image "default" .Chart.AppVersion) }}
{{- end }}

{{/* The OTLP endpoint Specgate exports to: the in-namespace collector when enabled. */}}
{{- define "specgate.otlpEndpoint" -}}
{{- if .Values.otelCollector.enabled }}
{{- $port := ternary 4317 4318 (eq .Values.telemetry.otlpProtocol "grpc") }}
{{- printf "http://%s.%s.svc:%d" (include "specgate.collectorName" .) .Release.Namespace $port }}
{{- else }}
{{- .Values.telemetry.otlpEndpoint }}
{{- end }}
{{- end }}

{{/* The TCP port of a URL: explicit, else 443 for https and 80 for http. */}}
{{- define "specgate.urlPort" -}}
{{- $url := urlParse . }}
{{- $hostPort := splitList ":" $url.host }}
{{- if eq (len $hostPort) 2 }}
{{- index $hostPort 1 }}
{{- else if eq $url.scheme "https" }}
{{- 443 }}
{{- else }}
{{- 80 }}
{{- end }}
{{- end }}

{{/*
Security contexts of the "restricted" Pod Security Standard, shared by every pod and
container of the chart. The UID matches the image's user.
*/}}
{{- define "specgate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "specgate.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The writable data directory, which also holds caches (the root filesystem is read-only). */}}
{{- define "specgate.dataEnv" -}}
- name: SPECGATE_DATA_DIR
  value: /var/lib/specgate
- name: HOME
  value: /var/lib/specgate
- name: XDG_CACHE_HOME
  value: /var/lib/specgate/cache
{{- end }}

{{/* Environment that gives a container the database URL from the operator's Secret. */}}
{{- define "specgate.databaseEnv" -}}
{{- include "specgate.databaseEnvAs" (dict "db" .Values.database "login" .Values.database) }}
{{- end }}

{{/* The same for the owner role that runs the migrations. */}}
{{- define "specgate.ownerDatabaseEnv" -}}
{{- include "specgate.databaseEnvAs" (dict "db" .Values.database "login" .Values.database.owner) }}
{{- end }}

{{/* "db": the database values; "login": the user, existingSecret, passwordKey, urlKey to use. */}}
{{- define "specgate.databaseEnvAs" -}}
{{- $db := .db }}
{{- $login := .login }}
{{- if $login.urlKey }}
- name: SPECGATE_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $login.existingSecret }}
      key: {{ $login.urlKey }}
{{- else }}
{{- /* libpq reads PGPASSWORD itself, so the password never has to be URL-encoded. */}}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $login.existingSecret }}
      key: {{ $login.passwordKey }}
- name: SPECGATE_DATABASE_URL
  value: {{ printf "postgresql+psycopg://%s@%s:%d/%s?sslmode=%s" $login.user $db.host (int $db.port) $db.name $db.sslmode | quote }}
{{- end }}
{{- if $db.caSecret }}
- name: PGSSLROOTCERT
  value: /var/run/secrets/specgate/database-ca/{{ $db.caKey }}
{{- end }}
{{- end }}

{{/*
Seconds the gateway lets streams run after SIGTERM: terminationGracePeriodSeconds less the
preStop pause and 10 s for the `shutdown` records and the final checkpoint.
*/}}
{{- define "specgate.shutdownGraceSeconds" -}}
{{- $grace := sub (sub (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds)) 10 -}}
{{- if lt $grace 0 }}{{ fail "terminationGracePeriodSeconds must exceed preStopSleepSeconds by at least 10 s" }}{{ end -}}
{{- $grace -}}
{{- end }}

{{/* The example vLLM Deployment's name; pool is "plain" or "speculative". */}}
{{- define "specgate.vllmName" -}}
{{- printf "%s-vllm-%s" (include "specgate.fullname" .ctx) .pool | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The gateway's backend block (JSON) when vllm.enabled: the servers given, or the
example Deployment's Services. */}}
{{- define "specgate.vllmBackend" -}}
{{- $v := .Values.vllm }}
{{- $servers := $v.servers }}
{{- if and (not $servers) $v.example.enabled }}
{{- $servers = list }}
{{- $pools := list "plain" }}
{{- if $v.example.speculativeConfig }}{{- $pools = append $pools "speculative" }}{{- end }}
{{- range $pools }}
{{- $server := dict "url" (printf "http://%s.%s.svc:%d" (include "specgate.vllmName" (dict "ctx" $ "pool" .)) $.Release.Namespace (int $v.port)) "served_model_name" $v.example.servedModelName "model_version" $v.example.modelVersion "pool" . }}
{{- if eq . "speculative" }}{{- $_ := set $server "speculative_config" $v.example.speculativeConfig }}{{- end }}
{{- $servers = append $servers $server }}
{{- end }}
{{- end }}
{{- dict "kind" "vllm" "vllm_servers" $servers | toJson }}
{{- end }}
