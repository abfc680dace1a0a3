{{/* Chart name (or nameOverride), truncated to the 63 characters a label value allows. */}}
{{- define "plimsoll.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: fullnameOverride, else the release name with the (overridden) chart name
appended unless already in it. */}}
{{- define "plimsoll.fullname" -}}
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

{{/* Labels that select the operator pod (must not change between upgrades). */}}
{{- define "plimsoll.selectorLabels" -}}
app.kubernetes.io/name: {{ include "plimsoll.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Recommended labels on every object of the release. */}}
{{- define "plimsoll.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "plimsoll.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: plimsoll
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "plimsoll.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "plimsoll.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image reference. */}}
{{- define "plimsoll.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Rules the operator needs, shared by the ClusterRole and the namespaced Roles. */}}
{{- define "plimsoll.rules" -}}
# LLMServices: watch them, record kopf's progress annotations, write status.
- apiGroups: ["plimsoll.dev"]
  resources: ["llmservices"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["plimsoll.dev"]
  resources: ["llmservices/status"]
  verbs: ["get", "patch", "update"]
# The built-in autoscaler writes replicas through the scale subresource.
- apiGroups: ["plimsoll.dev"]
  resources: ["llmservices/scale"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["plimsoll.dev"]
  resources: ["llmservices/finalizers"]
  verbs: ["update"]
# Children: server-side apply creates and patches; watches restore deleted ones.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# model.cache.prefill: the DaemonSet that fills a node-local model cache ahead.
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["get", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# The autoscaler lists replica pods to scrape their /metrics; its two-phase scale-down
# patches the pods it drains (label plimsoll.dev/draining, controller.kubernetes.io/pod-deletion-cost).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
# Scrape objects and alert rules, only used when the Prometheus Operator's CRDs exist.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors", "servicemonitors", "prometheusrules"]
  verbs: ["get", "create", "patch", "update", "delete"]
# The InferencePool of router.mode inferencePool, only used when the Gateway API Inference Extension is installed.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "update", "delete"]
# Multi-node replicas (resources.nodes > 1), only used when the LeaderWorkerSet API is installed.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "create", "patch", "update", "delete"]
# Events explaining what the operator did.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# One Secret per LLMService (<name>-admin-key: the replicas' admin key, Ray's token), created
# once and read back for the operator's own calls to its replicas. No list or watch: RBAC
# cannot narrow get to those names, so get is the one read the operator has on Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# One NetworkPolicy per LLMService: who may reach its replicas.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
{{- end -}}

{{/* The namespaces the operator manages: watchNamespaces, else (namespaced RBAC) its own. */}}
{{- define "plimsoll.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else if eq .Values.rbac.scope "namespaced" -}}
{{- toJson (list .Release.Namespace) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}
