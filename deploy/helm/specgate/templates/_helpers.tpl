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

{{/* A vLLM pool's StatefulSet and headless Service name: pass (dict "ctx" $ "pool" $pool).
At most 52 characters, so that its pods' controller-revision-hash labels stay valid. */}}
{{- define "specgate.vllmName" -}}
{{- $name := printf "%s-vllm-%s" (include "specgate.fullname" .ctx) .pool.name }}
{{- if gt (len $name) 52 }}
{{- fail (printf "vllm.pools %s: the name %s is longer than 52 characters; shorten the pool's name or fullnameOverride" .pool.name $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* GPUs per replica of a pool: gpus, else tensorParallelSize. */}}
{{- define "specgate.vllmGpus" -}}
{{- $tp := int (default 1 .tensorParallelSize) }}
{{- if and (hasKey . "gpus") (not (kindIs "invalid" .gpus)) }}
{{- int .gpus }}
{{- else }}
{{- $tp }}
{{- end }}
{{- end }}

{{/*
The gateway's vLLM servers per served model (JSON): "" holds the one model's (vllm.servers,
then the pools without gatewayModel), every other key a config.models entry's. Each pool
contributes one server per replica, by the replica's stable DNS name behind the headless
Service, so that the gateway balances and checks every replica itself. Also checks the
pools against each other and against config.models.
*/}}
{{- define "specgate.vllmBackends" -}}
{{- $v := .Values.vllm }}
{{- $pools := $v.pools | default list }}
{{- if and $pools (not $v.enabled) }}
{{- fail "vllm.pools needs vllm.enabled: true" }}
{{- end }}
{{- $known := dict }}
{{- range (.Values.config.models | default list) }}{{- $_ := set $known .name true }}{{- end }}
{{- $sharedVolume := or .Values.models.existingClaim .Values.models.volume }}
{{- $servers := dict "" (concat list ($v.servers | default list)) }}
{{- $seen := dict }}
{{- range $pool := $pools }}
{{- if hasKey $seen $pool.name }}
{{- fail (printf "vllm.pools: two pools named %s" $pool.name) }}
{{- end }}
{{- $_ := set $seen $pool.name true }}
{{- $model := $pool.gatewayModel | default "" }}
{{- if and $model (not (hasKey $known $model)) }}
{{- fail (printf "vllm.pools %s: gatewayModel %s is no config.models entry" $pool.name $model) }}
{{- end }}
{{- if lt (int (include "specgate.vllmGpus" $pool)) (int (default 1 $pool.tensorParallelSize)) }}
{{- fail (printf "vllm.pools %s: fewer GPUs than tensorParallelSize" $pool.name) }}
{{- end }}
{{- $image := (($pool.modelImage | default dict).reference) | default "" }}
{{- if and (not $pool.modelVersion) (or $image (not $sharedVolume)) }}
{{- fail (printf "vllm.pools %s: give modelVersion, or the shared model volume (models.existingClaim or models.volume) that the gateway reads the manifest from" $pool.name) }}
{{- end }}
{{- $name := include "specgate.vllmName" (dict "ctx" $ "pool" $pool) }}
{{- range $i := until (int (default 1 $pool.replicas)) }}
{{- $server := dict "url" (printf "http://%s-%d.%s.%s.svc:%d" $name $i $name $.Release.Namespace (int $v.port)) "served_model_name" $pool.servedModelName }}
{{- if $pool.modelVersion }}
{{- $_ := set $server "model_version" $pool.modelVersion }}
{{- else }}
{{- $_ := set $server "model_dir" (printf "%s/%s" $.Values.models.mountPath $pool.model) }}
{{- end }}
{{- if $pool.speculativeConfig }}
{{- $_ := set $server "speculative_config" $pool.speculativeConfig }}
{{- $_ := set $server "pool" "speculative" }}
{{- else }}
{{- $_ := set $server "pool" "plain" }}
{{- end }}
{{- $_ := set $servers $model (append (get $servers $model | default list) $server) }}
{{- end }}
{{- end }}
{{- if and $v.enabled (not (get $servers "")) (not $pools) }}
{{- fail "vllm.enabled needs vllm.servers or vllm.pools" }}
{{- end }}
{{- $servers | toJson }}
{{- end }}

{{/* The gateway's configuration file: config, with the backends generated from vllm. */}}
{{- define "specgate.gatewayConfig" -}}
{{- $config := deepCopy .Values.config }}
{{- if .Values.vllm.enabled }}
{{- $backends := include "specgate.vllmBackends" . | fromJson }}
{{- with get $backends "" }}
{{- $_ := set $config "backend" (dict "kind" "vllm" "vllm_servers" .) }}
{{- end }}
{{- $models := list }}
{{- range $entry := ($config.models | default list) }}
{{- with get $backends $entry.name }}
{{- if hasKey $entry "backend" }}
{{- fail (printf "config.models %s: backend is generated from vllm.pools; leave it out" $entry.name) }}
{{- end }}
{{- $_ := set $entry "backend" (dict "kind" "vllm" "vllm_servers" .) }}
{{- end }}
{{- $models = append $models $entry }}
{{- end }}
{{- if $config.models }}
{{- $_ := set $config "models" $models }}
{{- end }}
{{- else }}
{{- $_ := include "specgate.vllmBackends" . }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* Gateway pods that always run: autoscaling's minimum, else replicaCount. */}}
{{- define "specgate.minReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ int .Values.autoscaling.minReplicas }}{{ else }}{{ int .Values.replicaCount }}{{ end }}
{{- end }}
