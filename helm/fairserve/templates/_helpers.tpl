{{/*
Names. Kubernetes names are at most 63 characters; the RayService's at most 47 (KubeRay appends
"-serve-svc"/"-head-svc" and a 5-character cluster suffix: MaxRayServiceNameLength = 53 - 6)
and a DNS-1035 label (a letter first: "fs-" is put before a name that starts otherwise).
*/}}
{{- define "fairserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fairserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fairserve.rayServiceName" -}}
{{- $name := include "fairserve.fullname" . | lower -}}
{{- if not (regexMatch "^[a-z]" $name) -}}
{{- $name = printf "fs-%s" $name -}}
{{- end -}}
{{- $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{/* A component's name: <fullname>-<component>, within 63 characters and a DNS-1035 label
(Services need one: "fs-" before a name that does not start with a letter). */}}
{{- define "fairserve.componentName" -}}
{{- $full := include "fairserve.fullname" .root -}}
{{- if not (regexMatch "^[a-z]" $full) -}}
{{- $full = printf "fs-%s" $full -}}
{{- end -}}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component -}}
{{- end -}}

{{- define "fairserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels. The stable ones only (name, instance, component) go on Ray pod templates: KubeRay hashes
rayClusterConfig, and a label that changes with the chart's version would rebuild the GPU
cluster on every chart upgrade. The full set (chart, version, managed-by) goes on everything
else.
*/}}
{{- define "fairserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fairserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fairserve.labels" -}}
helm.sh/chart: {{ include "fairserve.chart" . }}
{{ include "fairserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fairserve
{{- end -}}

{{/* Images: a tag (default: the chart's appVersion, or appVersion-cuda) or a digest. */}}
{{- define "fairserve.imageRef" -}}
{{- $registry := .global.imageRegistry -}}
{{- $repo := .image.repository -}}
{{- if $registry -}}{{- $repo = printf "%s/%s" $registry $repo -}}{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .defaultTag .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "fairserve.image" -}}
{{- include "fairserve.imageRef" (dict "global" .Values.global "image" .Values.image "defaultTag" .Chart.AppVersion) -}}
{{- end -}}

{{- define "fairserve.gpuImage" -}}
{{- include "fairserve.imageRef" (dict "global" .Values.global "image" .Values.gpuImage "defaultTag" (printf "%s-cuda" .Chart.AppVersion)) -}}
{{- end -}}

{{- define "fairserve.redisImage" -}}
{{- include "fairserve.imageRef" (dict "global" .Values.global "image" .Values.redis.embedded.image "defaultTag" "") -}}
{{- end -}}

{{- define "fairserve.imagePullSecrets" -}}
{{- $secrets := concat (.Values.global.imagePullSecrets | default list) (.Values.imagePullSecrets | default list) | uniq -}}
{{- if $secrets -}}
imagePullSecrets:
{{- range $secrets }}
  - name: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Redis: the service of the embedded one, and the URL the cluster uses (no password). */}}
{{- define "fairserve.redisName" -}}
{{- include "fairserve.componentName" (dict "root" . "component" "redis") -}}
{{- end -}}

{{- define "fairserve.redisHost" -}}
{{- printf "%s.%s.svc" (include "fairserve.redisName" .) .Release.Namespace -}}
{{- end -}}

{{/* The Secret (and its key) with the Redis password; empty: no password. */}}
{{- define "fairserve.redisPasswordSecret" -}}
{{- if eq .Values.redis.mode "embedded" -}}
{{- if .Values.redis.embedded.auth.enabled -}}{{- .Values.redis.embedded.auth.existingSecret -}}{{- end -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* "true" when the embedded Redis has an ACL user per role (redis.embedded.auth.roleUsers). */}}
{{- define "fairserve.redisRoleUsers" -}}
{{- if and (eq .Values.redis.mode "embedded") .Values.redis.embedded.auth.enabled .Values.redis.embedded.auth.roleUsers -}}true{{- end -}}
{{- end -}}

{{/* The Redis user and the key of its password in the Secret for a Ray pod's component
(head, routers, model-<group>): "<user> <key>"; the default user on the head. */}}
{{- define "fairserve.redisRole" -}}
{{- $root := .root -}}
{{- $auth := $root.Values.redis.embedded.auth -}}
{{- if and (include "fairserve.redisRoleUsers" $root) (eq .component "routers") -}}
fairserve-router {{ $auth.routerPasswordKey }}
{{- else if and (include "fairserve.redisRoleUsers" $root) (hasPrefix "model-" .component) -}}
fairserve-replica {{ $auth.replicaPasswordKey }}
{{- else -}}
- {{ include "fairserve.redisPasswordKey" $root }}
{{- end -}}
{{- end -}}

{{- define "fairserve.redisPasswordKey" -}}
{{- if eq .Values.redis.mode "embedded" -}}
{{- .Values.redis.embedded.auth.passwordKey -}}
{{- else -}}
{{- .Values.redis.external.passwordKey -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL the cluster uses, without its password. */}}
{{- define "fairserve.redisUrl" -}}
{{- if eq .Values.redis.mode "embedded" -}}
{{- printf "redis://%s:6379/0" (include "fairserve.redisHost" .) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* The settings tree the cluster runs with (cluster/settings.py), as serveConfigV2 args. */}}
{{- define "fairserve.settings" -}}
{{- $s := deepCopy .Values.fairserve -}}
{{- $engine := $s.engine -}}
{{- with .Values.model.path -}}{{- $_ := set $engine "model" . -}}{{- end -}}
{{- if .Values.model.cacheDir -}}{{- $_ := set $engine "model_cache_dir" .Values.model.cacheDir -}}{{- end -}}
{{- $_ := set $engine "device" (ternary "cuda" "cpu" (gt (float64 $s.replicas.num_gpus) 0.0)) -}}
{{- $_ := set $s.replicas "resources" (dict "fairserve_model" 1) -}}
{{- range $s.models -}}
{{- /* what a model's replicas leave out is the default model's (fairserve.replicas) */ -}}
{{- $_ := set . "replicas" (merge (deepCopy (.replicas | default dict)) (deepCopy $s.replicas)) -}}
{{- if not .engine.model -}}{{- $_ := unset .engine "model" -}}{{- end -}}
{{- $_ := set .engine "device" (ternary "cuda" "cpu" (gt (float64 .replicas.num_gpus) 0.0)) -}}
{{- $_ := set .replicas "resources" (dict "fairserve_model" 1) -}}
{{- end -}}
{{- $_ := set $s.router "resources" (dict "fairserve_router" 1) -}}
{{- $_ := set $s.router "host" "0.0.0.0" -}}
{{- $_ := set $s.router "port" 8000 -}}
{{- $_ := set $s.router.api "metrics_host" "0.0.0.0" -}}{{/* the pod's port: PodMonitor, NetworkPolicy */}}
{{- $_ := set $s.router.api "admin_host" "0.0.0.0" -}}{{/* the pod's port: the admin Service, NetworkPolicy */}}
{{- if .Values.admin.existingSecret -}}
{{- $_ := set $s.router.api "admin_tokens_file" "/etc/fairserve/admin/admin-tokens.yaml" -}}
{{- end -}}
{{- $_ := set $s "redis" (dict "url" (include "fairserve.redisUrl" .)) -}}
{{- if .Values.tenants.existingSecret -}}
{{- $_ := set $s "tenants" (dict "file" "/etc/fairserve/tenants/tenants.yaml" "create_demo" false) -}}
{{- end -}}
{{- toYaml $s -}}
{{- end -}}



{{- define "fairserve.modelClaim" -}}
{{- if .Values.model.pvc.existingClaim -}}
{{- .Values.model.pvc.existingClaim -}}
{{- else -}}
{{- include "fairserve.componentName" (dict "root" . "component" "models") -}}
{{- end -}}
{{- end -}}

{{/* Security contexts: the chart's, for every container (Ray ones included). */}}
{{- define "fairserve.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "fairserve.containerSecurityContext" -}}
{{- toYaml .Values.securityContext -}}
{{- end -}}

{{/* A CPU quantity ("4", "500m", 2) as a number of CPUs. */}}
{{- define "fairserve.cpus" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}
{{- divf (trimSuffix "m" $q | float64) 1000 -}}
{{- else -}}
{{- $q | float64 -}}
{{- end -}}
{{- end -}}
