{{/*
serveConfigV2: the one application (cluster/serve_app.py builds it from the settings tree in
`args`) and its deployments' options (the router, and each model's replicas). The options are what cluster/app.py's build_app sets
from the same settings (tests/helm checks the two agree); written here, they are visible in the
RayService and a change to them is an in-place Serve update. No secret is in here: the Redis URL
is written without its password (each process adds it from its environment).
*/}}
{{- define "fairserve.serveConfig" -}}
{{- $s := include "fairserve.settings" . | fromYaml -}}
{{- $ro := $s.router -}}
{{- $router := dict "name" "Router" "num_replicas" $ro.num_replicas "max_ongoing_requests" $ro.max_ongoing_requests "graceful_shutdown_timeout_s" $ro.graceful_shutdown_timeout_s "ray_actor_options" (dict "num_cpus" $ro.num_cpus "resources" $ro.resources) -}}
{{- $deployments := list $router (include "fairserve.replicaDeployment" (dict "name" "ModelReplica" "pool" "" "r" $s.replicas "redisUrl" $s.redis.url) | fromYaml) -}}
{{- range $s.models -}}
{{- $pool := .engine.served_model_name -}}
{{- $deployments = append $deployments (include "fairserve.replicaDeployment" (dict "name" (printf "ModelReplica-%s" $pool) "pool" $pool "r" .replicas "redisUrl" $s.redis.url) | fromYaml) -}}
{{- end -}}
{{- $app := dict "name" "fairserve" "route_prefix" "/" "import_path" "cluster.serve_app:build" "args" (dict "settings" $s) "deployments" $deployments -}}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}

{{/* One model's replica deployment options (cluster/app.py's _replica_deployment): name,
pool (its queues), r (its replicas settings), redisUrl. */}}
{{- define "fairserve.replicaDeployment" -}}
{{- $r := .r -}}
{{- $replica := dict "name" .name "max_ongoing_requests" $r.max_ongoing_requests "health_check_period_s" $r.health_check_period_s "health_check_timeout_s" $r.health_check_timeout_s "graceful_shutdown_timeout_s" (addf $r.graceful_shutdown_timeout_s 5) "ray_actor_options" (dict "num_cpus" $r.num_cpus "num_gpus" $r.num_gpus "resources" $r.resources) -}}
{{- if $r.autoscaling -}}
{{- $a := $r.autoscaling -}}
{{- /* as AutoscaleSettings.floor: scale to zero only when allowed */ -}}
{{- $floor := ternary (int $a.min_replicas) (max (int $a.min_replicas) 1) $a.allow_scale_to_zero -}}
{{- $policy := dict "policy_function" "cluster.autoscaling:BacklogPolicy" "policy_kwargs" (dict "redis_url" .redisUrl "settings" $a "pool" .pool) -}}
{{- $_ := set $replica "autoscaling_config" (dict "min_replicas" $floor "max_replicas" $a.max_replicas "initial_replicas" $floor "upscale_delay_s" 0.0 "downscale_delay_s" 0.0 "downscale_to_zero_delay_s" 0.0 "metrics_interval_s" $a.metrics_interval_s "look_back_period_s" (mulf 2 $a.metrics_interval_s) "policy" $policy) -}}
{{- else -}}
{{- $_ := set $replica "num_replicas" $r.num_replicas -}}
{{- end -}}
{{- toYaml $replica -}}
{{- end -}}

{{/* host:port of the Redis that Ray's GCS fault tolerance uses. */}}
{{- define "fairserve.gcsRedisAddress" -}}
{{- if .Values.gcsFaultTolerance.redisAddress -}}
{{- .Values.gcsFaultTolerance.redisAddress -}}
{{- else -}}
{{- printf "%s:6379" (include "fairserve.redisHost" .) -}}
{{- end -}}
{{- end -}}
