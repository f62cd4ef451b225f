{{/* Names, labels and the pieces every workload shares. */}}
{{- define "blitzmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "blitzmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" NAME) */}}
{{- define "blitzmesh.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every worker StatefulSet's pods carry this, for the worker Service and the policies. */}}
{{- define "blitzmesh.workerSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
blitzmesh.io/worker: "true"
{{- end -}}

{{/* Pods holding a shard of the parameter pool (index and host caches): one per node. */}}
{{- define "blitzmesh.shardSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
blitzmesh.io/shard: "true"
{{- end -}}

{{/* Workers the manager may load: every worker pod of every pool. */}}
{{- define "blitzmesh.workerCount" -}}
{{- if .Values.disagg.enabled -}}
{{- add .Values.workers.replicas .Values.disagg.prefill .Values.disagg.decode -}}
{{- else -}}
{{- .Values.workers.replicas -}}
{{- end -}}
{{- end -}}

{{- define "blitzmesh.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{/* The downward-API variables the containers' $(VAR) arguments use. */}}
{{- define "blitzmesh.podEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* Native gRPC probes on the plaintext health-only port (kubelet speaks no TLS); the mTLS port
     keeps every other call. Startup allows a slow first start (a cold model load, a pull). */}}
{{- define "blitzmesh.probes" -}}
startupProbe:
  grpc: {port: {{ .healthPort }}}
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  grpc: {port: {{ .healthPort }}}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ .healthPort }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* The container ports every service has: (dict "grpc" PORT "health" PORT "metrics" PORT) */}}
{{- define "blitzmesh.ports" -}}
- {name: grpc, containerPort: {{ .grpc }}, protocol: TCP}
- {name: metrics, containerPort: {{ .metrics }}, protocol: TCP}
- {name: health, containerPort: {{ .health }}, protocol: TCP}
{{- end -}}

{{/* The Secret or cert-manager secrets a role's pods mount at /tls: its own certificate and key,
     the CA, and (data-plane roles) the data plane's key. (dict "root" $ "role" ROLE "dataplane" BOOL) */}}
{{- define "blitzmesh.tlsVolume" -}}
- name: tls
  projected:
    defaultMode: 0400
    sources:
{{- if .root.Values.tls.certManager.enabled }}
    - secret:
        name: {{ include "blitzmesh.fullname" .root }}-{{ .role }}-tls
        items:
        - {key: ca.crt, path: ca.pem}
        - {key: tls.crt, path: {{ .role }}.pem}
        - {key: tls.key, path: {{ .role }}.key}
{{- if .dataplane }}
    - secret:
        name: {{ .root.Values.tls.dataplaneKeySecret | default (printf "%s-dataplane-key" (include "blitzmesh.fullname" .root)) }}
        items:
        - {key: dataplane.key, path: dataplane.key}
{{- end }}
{{- else }}
    - secret:
        name: {{ required "tls.secretName: a Secret with ca.pem, <role>.pem, <role>.key and dataplane.key (docs/deploy.md), or tls.certManager.enabled" .root.Values.tls.secretName }}
        items:
        - {key: ca.pem, path: ca.pem}
        - {key: {{ .role }}.pem, path: {{ .role }}.pem}
        - {key: {{ .role }}.key, path: {{ .role }}.key}
{{- if .dataplane }}
        - {key: dataplane.key, path: dataplane.key}
{{- end }}
{{- end }}
{{- end -}}

{{- define "blitzmesh.securityContext" -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end -}}
