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

{{- define "blitzmesh.dataplaneKeySecret" -}}
{{- .Values.tls.dataplaneKeySecret | default (printf "%s-dataplane-key" (include "blitzmesh.fullname" .)) -}}
{{- end -}}

{{- define "blitzmesh.tlsSecretName" -}}
{{- required "tls.secretName: a Secret with ca.pem, <role>.pem, <role>.key, one <role>.<instance>.pem and .key per worker and host cache, and dataplane.key (docs/deploy.md), or tls.certManager.enabled" .Values.tls.secretName -}}
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
        name: {{ include "blitzmesh.dataplaneKeySecret" .root }}
        items:
        - {key: dataplane.key, path: dataplane.key}
{{- end }}
{{- else }}
    - secret:
        name: {{ include "blitzmesh.tlsSecretName" .root }}
        items:
        - {key: ca.pem, path: ca.pem}
        - {key: {{ .role }}.pem, path: {{ .role }}.pem}
        - {key: {{ .role }}.key, path: {{ .role }}.key}
{{- if .dataplane }}
        - {key: dataplane.key, path: dataplane.key}
{{- end }}
{{- end }}
{{- end -}}

{{/* The pods of one per-instance StatefulSet (workers, host caches), each with the instance id
     its certificate must name (services/common/pki.py spiffe_id): a JSON list of
     {"pod", "instance"}. (dict "root" $ "name" STATEFULSET-NAME "start" FIRST-ORDINAL "replicas" N
     "instance" "pod" | PREFIX) : a worker's instance id is its pod name, a host cache's
     host-cache-<ordinal> (its cache slot). */}}
{{- define "blitzmesh.instancePods" -}}
{{- $pods := list }}
{{- $start := int .start }}
{{- range $i := until (int .replicas) }}
{{- $ordinal := add $i $start }}
{{- $pod := printf "%s-%d" $.name $ordinal }}
{{- $pods = append $pods (dict "pod" $pod "instance" (ternary $pod (printf "%s-%d" $.instance $ordinal) (eq $.instance "pod"))) }}
{{- end }}
{{- toJson $pods }}
{{- end -}}

{{/* /tls of a per-instance pod: the mesh's layout with the pod's own certificate and no other
     instance's (docs/deploy.md). Secret mode and a host cache's per-slot Certificates: one
     projected volume holding a directory per pod (<pod>/ca.pem, <pod>/<role>/<id>.pem|.key,
     <pod>/dataplane.key), of which the container mounts only its own (subPathExpr $(POD_NAME));
     a worker with cert-manager: the csi-driver issues the pod a key and certificate of its own
     at /tls/own, the SPIFFE URI naming the pod. Takes the dict of "blitzmesh.instancePods" plus
     "role" ROLE; the two defines give the volumes and the container's volumeMounts. */}}
{{- define "blitzmesh.instanceTlsVolumes" -}}
{{- $root := .root }}
{{- $fullname := include "blitzmesh.fullname" $root }}
{{- $pods := include "blitzmesh.instancePods" . | fromJsonArray }}
{{- $csi := and $root.Values.tls.certManager.enabled (eq .instance "pod") }}
- name: tls
  projected:
    defaultMode: 0400
    sources:
{{- if $csi }}
    - secret:
        name: {{ include "blitzmesh.dataplaneKeySecret" $root }}
        items:
        - {key: dataplane.key, path: dataplane.key}
- name: tls-own
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $root.Values.tls.certManager.issuerRef.name | quote }}
      csi.cert-manager.io/issuer-kind: {{ $root.Values.tls.certManager.issuerRef.kind | default "Issuer" | quote }}
      csi.cert-manager.io/issuer-group: {{ $root.Values.tls.certManager.issuerRef.group | default "cert-manager.io" | quote }}
      csi.cert-manager.io/common-name: {{ .role | quote }}
      csi.cert-manager.io/dns-names: {{ .role | quote }}
      csi.cert-manager.io/uri-sans: {{ printf "spiffe://blitzmesh/%s/${POD_NAME}" .role | quote }}
      csi.cert-manager.io/key-usages: "server auth,client auth,digital signature"
      csi.cert-manager.io/duration: {{ $root.Values.tls.certManager.duration | quote }}
      csi.cert-manager.io/renew-before: {{ $root.Values.tls.certManager.renewBefore | quote }}
      csi.cert-manager.io/certificate-file: tls.crt
      csi.cert-manager.io/privatekey-file: tls.key
      csi.cert-manager.io/ca-file: ca.crt
{{- else if $root.Values.tls.certManager.enabled }}
{{- range $pods }}
    - secret:
        name: {{ $fullname }}-{{ .instance }}-tls
        items:
        - {key: ca.crt, path: {{ .pod }}/ca.pem}
        - {key: tls.crt, path: {{ .pod }}/{{ $.role }}/{{ .instance }}.pem}
        - {key: tls.key, path: {{ .pod }}/{{ $.role }}/{{ .instance }}.key}
    - secret:
        name: {{ include "blitzmesh.dataplaneKeySecret" $root }}
        items:
        - {key: dataplane.key, path: {{ .pod }}/dataplane.key}
{{- end }}
{{- else }}
    - secret:
        name: {{ include "blitzmesh.tlsSecretName" $root }}
        items:
{{- range $pods }}
        - {key: ca.pem, path: {{ .pod }}/ca.pem}
        - {key: {{ $.role }}.{{ .instance }}.pem, path: {{ .pod }}/{{ $.role }}/{{ .instance }}.pem}
        - {key: {{ $.role }}.{{ .instance }}.key, path: {{ .pod }}/{{ $.role }}/{{ .instance }}.key}
        - {key: dataplane.key, path: {{ .pod }}/dataplane.key}
{{- end }}
{{- end }}
{{- end -}}

{{- define "blitzmesh.instanceTlsMounts" -}}
{{- if and .root.Values.tls.certManager.enabled (eq .instance "pod") }}
- {name: tls, mountPath: /tls, readOnly: true}
- {name: tls-own, mountPath: /tls/own, readOnly: true}
{{- else }}
- {name: tls, mountPath: /tls, subPathExpr: $(POD_NAME), readOnly: true}
{{- end }}
{{- end -}}

{{- define "blitzmesh.securityContext" -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end -}}
