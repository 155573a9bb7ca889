#!/usr/bin/env bash
# End-to-end on a real cluster: creates a kind cluster, builds the image and
# loads it into the nodes, deploys konnectivity-rs from manifests/overlays/kind
# and checks it:
#   egress        kubectl logs, exec and port-forward reach a pod through
#                 proxy-server (kube-apiserver's egress selector points at it)
#   node-to-KAS   a pod and the worker's kubelet reach the API server through
#                 the kubernetes service VIP, captured and tunnelled
# The cluster is deleted on exit (KEEP_CLUSTER=1 keeps it).
#
# Usage: hack/kind-e2e.sh [node-to-kas|egress]
#   node-to-kas (default)  agents authenticate by certificate; node agent DaemonSet with capture
#   egress                 agents authenticate by ServiceAccount token (TokenReview); egress only
# Needs docker, kind, kubectl, openssl and curl on this machine, and network
# access for the base images and the test pods' images.
set -euo pipefail

mode=${1:-node-to-kas}
case $mode in
  node-to-kas | egress) ;;
  *) echo "kind-e2e.sh: unknown mode '$mode' (node-to-kas or egress)" >&2; exit 2 ;;
esac

missing=()
for tool in docker kind kubectl openssl curl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "kind-e2e.sh: missing ${missing[*]}: this script needs docker, kind, kubectl, openssl and curl" >&2
  echo "  (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)" >&2
  exit 2
fi
if ! docker info >/dev/null 2>&1; then
  echo "kind-e2e.sh: docker is installed but its daemon does not answer (docker info failed)" >&2
  exit 2
fi

cd "$(dirname "$0")/.."
cluster=${KIND_CLUSTER_NAME:-konnectivity-e2e}
image=konnectivity-rs:dev
control_plane=$cluster-control-plane
worker=$cluster-worker
work=$(mktemp -d)
export KUBECONFIG=$work/kubeconfig
port_forward_pid=""

cleanup() {
  local status=$?
  [[ -n $port_forward_pid ]] && kill "$port_forward_pid" 2>/dev/null || true
  if ((status != 0)); then
    echo "== FAILED; state of kube-system:" >&2
    kubectl -n kube-system get pods -o wide >&2 || true
    for pod in $(kubectl -n kube-system get pods -o name 2>/dev/null | grep konnectivity); do
      echo "--- $pod" >&2
      kubectl -n kube-system logs "$pod" --all-containers --tail=40 >&2 || true
    done
  fi
  if [[ ${KEEP_CLUSTER:-0} == 1 ]]; then
    echo "== keeping cluster $cluster (KUBECONFIG=$KUBECONFIG)"
  else
    kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
    rm -rf "$work"
  fi
  exit "$status"
}
trap cleanup EXIT

step() { echo "== $*"; }

# Waits up to $1 seconds for the command after it to succeed.
wait_for() {
  local limit=$1
  shift
  for ((i = 0; i < limit; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "kind-e2e.sh: timed out after ${limit}s waiting for: $*" >&2
  return 1
}

# A metric's value from a node's loopback health port (0 when absent).
metric() { # node, port, series
  docker exec "$1" curl -sf "http://127.0.0.1:$2/metrics" |
    awk -v s="$3" 'index($0, s" ") == 1 { print $2; found = 1 } END { if (!found) print 0 }'
}

step "building $image"
# The same build and smoke test as CI's (hack/image.sh), with this machine's daemon.
bash hack/image.sh "$image"

step "creating kind cluster $cluster"
kind create cluster --name "$cluster" --config hack/kind/cluster.yaml --kubeconfig "$KUBECONFIG" --wait 120s
kind load docker-image "$image" --name "$cluster"
cp_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$control_plane")
kas_endpoint=$cp_ip:6443

step "certificates (hack/gen-certs.sh --cluster)"
hack/gen-certs.sh --cluster "$work/pki" --server-san "DNS:$control_plane" --server-san "IP:$cp_ip" \
  --server-san IP:127.0.0.1 --control-plane-agent konnectivity-cp-1 --node nodes
docker exec "$control_plane" mkdir -p /etc/kubernetes/konnectivity/pki
for file in cluster-ca.crt server.crt server.key node-client-ca.crt konnectivity-cp-1.crt konnectivity-cp-1.key; do
  docker cp "$work/pki/$file" "$control_plane:/etc/kubernetes/konnectivity/pki/$file"
done
kubectl -n kube-system create configmap konnectivity \
  --from-literal=proxy-server-host="$cp_ip" --from-literal=kas-endpoint="$kas_endpoint"

# Writes each Pod of a rendered kustomization to the control plane's static pod directory.
install_static_pods() { # kustomization dir
  kubectl kustomize "$1" | sed "s/192\.0\.2\.10:6443/$kas_endpoint/g" > "$work/static.yaml"
  awk -v dir="$work" '/^---$/ { n++; next } { print > (dir "/static-" n+0 ".yaml") }' "$work/static.yaml"
  for file in "$work"/static-*.yaml; do
    name=$(awk '/^  name: / { print $2; exit }' "$file")
    docker cp "$file" "$control_plane:/etc/kubernetes/manifests/$name.yaml"
  done
  rm -f "$work"/static-*.yaml
}

if [[ $mode == egress ]]; then
  step "kubeconfig for proxy-server's TokenReviews (user system:konnectivity-server)"
  docker cp "$control_plane:/etc/kubernetes/pki/ca.crt" "$work/kube-ca.crt"
  docker cp "$control_plane:/etc/kubernetes/pki/ca.key" "$work/kube-ca.key"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=system:konnectivity-server \
    -keyout "$work/reviewer.key" -out "$work/reviewer.csr" 2>/dev/null
  openssl x509 -req -in "$work/reviewer.csr" -CA "$work/kube-ca.crt" -CAkey "$work/kube-ca.key" \
    -CAcreateserial -days 2 -out "$work/reviewer.crt" 2>/dev/null
  reviewer=$work/konnectivity-server.conf
  kubectl --kubeconfig "$reviewer" config set-cluster kind --server=https://127.0.0.1:6443 \
    --certificate-authority="$work/kube-ca.crt" --embed-certs=true >/dev/null
  kubectl --kubeconfig "$reviewer" config set-credentials system:konnectivity-server \
    --client-certificate="$work/reviewer.crt" --client-key="$work/reviewer.key" --embed-certs=true >/dev/null
  kubectl --kubeconfig "$reviewer" config set-context default --cluster=kind \
    --user=system:konnectivity-server >/dev/null
  kubectl --kubeconfig "$reviewer" config use-context default >/dev/null
  docker cp "$reviewer" "$control_plane:/etc/kubernetes/konnectivity-server.conf"
  kubectl -n kube-system create configmap konnectivity-ca --from-file=ca.crt="$work/pki/cluster-ca.crt"
  step "deploying egress (token authentication)"
  install_static_pods manifests/overlays/kind/egress-control-plane
  kubectl apply -k manifests/overlays/kind/egress
  agents=konnectivity-agent
else
  kubectl -n kube-system create secret generic konnectivity-agent-certs \
    --from-file=ca.crt="$work/pki/cluster-ca.crt" \
    --from-file=agent.crt="$work/pki/agent.crt" --from-file=agent.key="$work/pki/agent.key" \
    --from-file=node.crt="$work/pki/node-nodes.crt" --from-file=node.key="$work/pki/node-nodes.key"
  step "deploying egress + node-to-KAS (certificates, node agent with capture)"
  install_static_pods manifests/overlays/kind/node-to-kas-control-plane
  kubectl apply -k manifests/overlays/kind/node-to-kas
  agents=konnectivity-node-agent
fi

step "pointing kube-apiserver's egress selector at proxy-server's socket"
docker cp manifests/control-plane/egress-selector-configuration.yaml \
  "$control_plane:/etc/kubernetes/egress-selector-configuration.yaml"
# kubeadm writes this manifest in a fixed layout: a flag after the command,
# a mount after "volumeMounts:", a volume after "volumes:". The kubelet
# restarts kube-apiserver when the file changes.
docker exec "$control_plane" sed -i \
  -e 's|^    - kube-apiserver$|&\n    - --egress-selector-config-file=/etc/kubernetes/egress-selector-configuration.yaml|' \
  -e 's|^    volumeMounts:$|&\n    - mountPath: /etc/kubernetes/egress-selector-configuration.yaml\n      name: egress-selector\n      readOnly: true\n    - mountPath: /etc/kubernetes/konnectivity-server\n      name: konnectivity-uds|' \
  -e 's|^  volumes:$|&\n  - hostPath:\n      path: /etc/kubernetes/egress-selector-configuration.yaml\n      type: File\n    name: egress-selector\n  - hostPath:\n      path: /etc/kubernetes/konnectivity-server\n      type: DirectoryOrCreate\n    name: konnectivity-uds|' \
  /etc/kubernetes/manifests/kube-apiserver.yaml
docker exec "$control_plane" grep -q egress-selector-config-file /etc/kubernetes/manifests/kube-apiserver.yaml
sleep 5
wait_for 180 kubectl get --raw /readyz
wait_for 120 docker exec "$control_plane" curl -sf http://127.0.0.1:8092/healthz
kubectl -n kube-system rollout status "daemonset/$agents" --timeout=180s
agents_connected() {
  local count
  count=$(metric "$control_plane" 8092 konnectivity_network_proxy_server_ready_backend_connections)
  ((${count%.*} >= 2))
}
wait_for 120 agents_connected

step "egress: logs, exec and port-forward through proxy-server"
dials_before=$(metric "$control_plane" 8092 konnectivity_network_proxy_server_dial_duration_seconds_count)
# A pod on the worker from the image already loaded: a proxy-agent with no
# server to reach still logs, has a shell, and serves /healthz on 40093.
kubectl run echo --image="$image" --restart=Never \
  --overrides='{"spec":{"nodeName":"'"$worker"'"}}' --command -- proxy-agent \
  --proxy-server-host=127.0.0.1 --proxy-server-port=40091 --health-server-port=40093 --admin-server-port=40094
kubectl wait --for=condition=Ready pod/echo --timeout=180s
wait_for 30 bash -c 'kubectl logs echo | grep -q "proxy-agent started"'
[[ $(kubectl exec echo -- cat /etc/hostname) == echo ]] || { echo "kubectl exec failed" >&2; exit 1; }
kubectl port-forward pod/echo 18093:40093 >"$work/port-forward.log" 2>&1 &
port_forward_pid=$!
wait_for 30 curl -sf http://127.0.0.1:18093/healthz
kill "$port_forward_pid"
port_forward_pid=""
dials_after=$(metric "$control_plane" 8092 konnectivity_network_proxy_server_dial_duration_seconds_count)
echo "   proxy-server dials: $dials_before -> $dials_after"
((${dials_after%.*} >= ${dials_before%.*} + 3)) || { echo "logs/exec/port-forward did not go through proxy-server" >&2; exit 1; }

if [[ $mode == node-to-kas ]]; then
  step "node-to-KAS: a pod reaches the API server through the VIP, captured"
  captured_series='konnectivity_network_proxy_agent_captured_connections_total{outcome="tunneled"}'
  before=$(metric "$worker" 8093 "$captured_series")
  kubectl run vip --image=docker.io/curlimages/curl:8.11.1 --restart=Never \
    --overrides='{"spec":{"nodeName":"'"$worker"'"}}' --command -- sh -c \
    'curl -sf --cacert /var/run/secrets/kubernetes.io/serviceaccount/ca.crt \
       -H "Authorization: Bearer $(cat /var/run/secrets/kubernetes.io/serviceaccount/token)" \
       https://10.96.0.1:443/version'
  pod_succeeded() { [[ $(kubectl get pod "$1" -o jsonpath='{.status.phase}') == Succeeded ]]; }
  wait_for 180 pod_succeeded vip
  kubectl logs vip | grep -q gitVersion
  after=$(metric "$worker" 8093 "$captured_series")
  echo "   worker's tunneled captures: $before -> $after"
  ((${after%.*} > ${before%.*})) || { echo "the pod's connection was not captured" >&2; exit 1; }

  step "node-to-KAS: the worker's kubelet talks to the API server through the VIP"
  docker exec "$worker" sed -i 's|server: https://.*|server: https://10.96.0.1:443|' /etc/kubernetes/kubelet.conf
  docker exec "$worker" systemctl restart kubelet
  before=$(metric "$worker" 8093 "$captured_series")
  sleep 20
  node_ready() {
    [[ $(kubectl get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]
  }
  wait_for 120 node_ready "$worker"
  after=$(metric "$worker" 8093 "$captured_series")
  echo "   worker's tunneled captures after the kubelet restart: $before -> $after"
  ((${after%.*} > ${before%.*})) || { echo "the kubelet's connections were not captured" >&2; exit 1; }
fi

step "all checks passed ($mode)"
