{{/*
The pod template of a Ray node (head, router group, model groups).

KubeRay's rules (ray-operator/controllers/ray/utils/validation.go, common/pod.go): the Ray
container is containers[0]; no probes of ours (KubeRay adds the Ray and Serve health probes) and
no /dev/shm volume (KubeRay mounts one sized from the memory limit); memory requests equal
limits. Only stable labels: this template is part of the cluster hash, and anything that changes
with a chart upgrade (chart version, checksums) would rebuild the cluster.

Arguments (a dict): root, component, image, resources {cpu, memory}, gpus, ephemeralStorage,
nodeSelector, tolerations, affinity, runtimeClassName, priorityClassName,
topologySpreadConstraints, ports (bool: the head's named ports).
*/}}
{{- define "fairserve.rayPodTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- /* its Redis user ("-": the default) and the Secret key of its password */ -}}
{{- $role := splitList " " (include "fairserve.redisRole" (dict "root" $root "component" .component)) -}}
metadata:
  labels:
    {{- include "fairserve.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  {{- with (include "fairserve.imagePullSecrets" $root) }}
  {{- . | nindent 2 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  automountServiceAccountToken: {{ eq .component "head" }}
  terminationGracePeriodSeconds: {{ $v.ray.terminationGracePeriodSeconds }}
  {{- with .priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := .tolerations | default list }}
  {{- if gt (int .gpus) 0 }}
  {{- $tolerations = append $tolerations (dict "key" $v.ray.accelerator.resourceName "operator" "Exists" "effect" "NoSchedule") }}
  {{- end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumes:
    # Ray's session files, Python's and HOME's (the root filesystem is read-only)
    - name: tmp
      emptyDir: {}
    {{- with include "fairserve.redisPasswordSecret" $root }}
    - name: redis-password
      secret:
        secretName: {{ . }}
        defaultMode: 0440
        items:
          # this pod's role's password only (redis.embedded.auth.roleUsers)
          - key: {{ index $role 1 }}
            path: password
    {{- end }}
    {{- if $v.tenants.existingSecret }}
    - name: tenants
      secret:
        secretName: {{ $v.tenants.existingSecret }}
        items:
          - key: {{ $v.tenants.key }}
            path: tenants.yaml
    {{- end }}
    {{- if $v.admin.existingSecret }}
    - name: admin-tokens
      secret:
        secretName: {{ $v.admin.existingSecret }}
        items:
          - key: {{ $v.admin.key }}
            path: admin-tokens.yaml
    {{- end }}
    {{- if eq $v.model.source "pvc" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ include "fairserve.modelClaim" $root }}
        readOnly: true
    {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" (eq .component "head") }}
      image: {{ .image }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      {{- $limits := dict "cpu" .resources.cpu "memory" .resources.memory }}
      {{- with .ephemeralStorage }}
      {{- $_ := set $limits "ephemeral-storage" . }}
      {{- end }}
      {{- if gt (int .gpus) 0 }}
      {{- $_ := set $limits $v.ray.accelerator.resourceName (toString .gpus) }}
      {{- end }}
      resources:
        requests:
          {{- toYaml $limits | nindent 10 }}
        limits:
          {{- toYaml $limits | nindent 10 }}
      env:
        - name: HOME
          value: /tmp/home
        - name: PYTHONDONTWRITEBYTECODE
          value: "1"
        # the Redis (without its password): `fairserve tenants ...` in a Ray pod needs no flag
        - name: FAIRSERVE_REDIS__URL
          value: {{ include "fairserve.redisUrl" $root | quote }}
        {{- if include "fairserve.redisPasswordSecret" $root }}
        # the Redis password: a mounted Secret, never in serveConfigV2 or an env value
        # (router/state/redis_client.py: every Ray process reads it from here)
        - name: FAIRSERVE_REDIS__PASSWORD_FILE
          value: /etc/fairserve/redis/password
        {{- if ne (index $role 0) "-" }}
        # its own Redis ACL user (redis.embedded.auth.roleUsers)
        - name: FAIRSERVE_REDIS__USERNAME
          value: {{ index $role 0 }}
        {{- end }}
        {{- end }}
        {{- with $v.telemetry.otlpEndpoint }}
        - name: OTEL_EXPORTER_OTLP_ENDPOINT
          value: {{ . | quote }}
        - name: OTEL_EXPORTER_OTLP_PROTOCOL
          value: {{ $v.telemetry.protocol | quote }}
        - name: OTEL_TRACES_SAMPLER
          value: {{ $v.telemetry.sampler | quote }}
        - name: OTEL_TRACES_SAMPLER_ARG
          value: {{ $v.telemetry.samplerArg | quote }}
        {{- end }}
        {{- if eq (toString $v.fairserve.router.ingress) "haproxy" }}
        # fairserve.router.ingress: haproxy (cluster/ingress.py): Ray Serve's throughput mode and
        # its HAProxy ingress on port 8000 of every Ray pod, before each router's own HTTP port
        - name: RAY_SERVE_THROUGHPUT_OPTIMIZED
          value: "1"
        - name: RAY_SERVE_ENABLE_HA_PROXY
          value: "1"
        {{- end }}
        {{- if $v.ray.quiet }}
        # ray.quiet (cluster/ray_quiet.py): Ray's own background work turned down; Ray's
        # metrics stay on (port 8080, what the PodMonitor scrapes: turning that on must not
        # change the pods and so rebuild the Ray cluster)
        - name: RAY_enable_task_events
          value: "0"
        - name: RAY_event_stats
          value: "0"
        - name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
          value: "0.5"
        - name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
          value: "1000"
        {{- end }}
        {{- with $v.ray.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if .ports }}
      ports:
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: serve, containerPort: 8000}
        - {name: metrics, containerPort: 8080}
        {{- with $v.fairserve.router.api.metrics_port }}
        - {name: fs-metrics, containerPort: {{ . }}}
        {{- end }}
        {{- with $v.fairserve.router.api.admin_port }}
        - {name: fs-admin, containerPort: {{ . }}}
        {{- end }}
      {{- else }}
      ports:
        - {name: metrics, containerPort: 8080}
        {{- with $v.fairserve.router.api.metrics_port }}
        - {name: fs-metrics, containerPort: {{ . }}}
        {{- end }}
        {{- with $v.fairserve.router.api.admin_port }}
        - {name: fs-admin, containerPort: {{ . }}}
        {{- end }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if include "fairserve.redisPasswordSecret" $root }}
        - name: redis-password
          mountPath: /etc/fairserve/redis
          readOnly: true
        {{- end }}
        {{- if $v.tenants.existingSecret }}
        - name: tenants
          mountPath: /etc/fairserve/tenants
          readOnly: true
        {{- end }}
        {{- if $v.admin.existingSecret }}
        - name: admin-tokens
          mountPath: /etc/fairserve/admin
          readOnly: true
        {{- end }}
        {{- if eq $v.model.source "pvc" }}
        - name: models
          mountPath: {{ $v.model.pvc.mountPath }}
          readOnly: true
        {{- end }}
{{- end -}}
