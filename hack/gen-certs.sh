#!/usr/bin/env bash
# Makes certificates with openssl.
#
# Demo (one CA for everything, two days), for hack/demo.sh and local runs:
#   hack/gen-certs.sh DIR
#     ca.{crt,key}        the CA
#     server.{crt,key}    proxy-server (frontend and agent listener), SANs localhost/127.0.0.1/::1
#     agent.{crt,key}     proxy-agent client certificate
#     client.{crt,key}    frontend client certificate (what kube-apiserver presents over TCP)
#
# Cluster (the CA split node-to-KAS needs, one year), for the manifests:
#   hack/gen-certs.sh --cluster DIR --server-san SAN [--server-san SAN ...] \
#       [--control-plane-agent ID ...] [--node NAME ...]
#     cluster-ca.{crt,key}      signs the server's certificate and agents' client certificates;
#                               proxy-server --cluster-ca-cert, proxy-agent --ca-cert
#     server.{crt,key}          proxy-server --cluster-cert/--cluster-key (agent listener and node
#                               frontend); SANs from --server-san (DNS:name or IP:address)
#     agent.{crt,key}           egress agents' client certificate (CN proxy-agent)
#     ID.{crt,key}              a control-plane agent's certificate: CN and DNS SAN are the agent id,
#                               which proxy-server --control-plane-agent-ids must list
#     node-client-ca.{crt,key}  a separate CA for node agents: proxy-server --node-client-ca-cert.
#                               Node certificates cannot pose as agents, nor agents as nodes.
#     node-NAME.{crt,key}       a node agent's --node-client-cert/--node-client-key
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

key_and_csr() { # name, subject CN
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
}

make_ca() { # name, CN, days
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$3" \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.crt" 2>/dev/null
}

issue() { # name, CN, extensions, CA name, days
  local name=$1 cn=$2 ext=$3 ca=$4 days=$5
  key_and_csr "$name" "$cn"
  printf '%s\n' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA "$ca.crt" -CAkey "$ca.key" -CAcreateserial -days "$days" \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

# Says what was made, where, and what each is for: the commands that use the
# files name them with the directory.
report() { # dir, then "file: what" lines
  local dir=$1
  shift
  echo "certificates in $dir (keys mode 0600):"
  printf '  %s\n' "$@"
}

demo() {
  local dir=$1
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  cd "$dir"
  make_ca ca konnectivity-demo-ca 2
  issue server proxy-server "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
extendedKeyUsage=serverAuth" ca 2
  issue agent proxy-agent "extendedKeyUsage=clientAuth" ca 2
  issue client kube-apiserver "extendedKeyUsage=clientAuth" ca 2
  rm -f ./*.srl
  chmod 600 ./*.key
  report "$dir" \
    "ca.crt ca.key          the CA (two days): proxy-server --cluster-ca-cert, proxy-agent --ca-cert" \
    "server.crt server.key  proxy-server --cluster-cert/--cluster-key; names localhost, 127.0.0.1, ::1" \
    "agent.crt agent.key    proxy-agent --agent-cert/--agent-key" \
    "client.crt client.key  a frontend client's (kube-apiserver's over TCP): proxy-test-client --client-cert/--client-key"
}

cluster() {
  local dir="" sans=() agents=() nodes=()
  while (($#)); do
    case $1 in
      --server-san) sans+=("${2:?--server-san needs a value such as DNS:cp.example or IP:10.0.0.2}"); shift 2 ;;
      --control-plane-agent) agents+=("${2:?--control-plane-agent needs an agent id}"); shift 2 ;;
      --node) nodes+=("${2:?--node needs a node name}"); shift 2 ;;
      -*) echo "gen-certs.sh: unknown option $1" >&2; usage ;;
      *) [[ -z $dir ]] || usage; dir=$1; shift ;;
    esac
  done
  [[ -n $dir ]] || usage
  ((${#sans[@]})) || { echo "gen-certs.sh: --cluster needs at least one --server-san" >&2; exit 2; }
  for san in "${sans[@]}"; do
    [[ $san == DNS:* || $san == IP:* ]] || { echo "gen-certs.sh: --server-san $san: use DNS:name or IP:address" >&2; exit 2; }
  done
  mkdir -p "$dir"
  cd "$dir"
  local days=365
  make_ca cluster-ca konnectivity-cluster-ca $days
  make_ca node-client-ca konnectivity-node-client-ca $days
  issue server proxy-server "subjectAltName=$(IFS=,; echo "${sans[*]}")
extendedKeyUsage=serverAuth" cluster-ca $days
  issue agent proxy-agent "extendedKeyUsage=clientAuth" cluster-ca $days
  for id in "${agents[@]}"; do
    issue "$id" "$id" "subjectAltName=DNS:$id
extendedKeyUsage=clientAuth" cluster-ca $days
  done
  for node in "${nodes[@]}"; do
    issue "node-$node" "system:node:$node" "extendedKeyUsage=clientAuth" node-client-ca $days
  done
  rm -f ./*.srl
  chmod 600 ./*.key
  local made=(
    "cluster-ca.crt/.key      signs the server's and agents' certificates: --cluster-ca-cert, proxy-agent --ca-cert"
    "server.crt/.key          proxy-server --cluster-cert/--cluster-key; names ${sans[*]}"
    "agent.crt/.key           egress agents' --agent-cert/--agent-key"
  )
  for id in "${agents[@]}"; do made+=("$id.crt/.key  control-plane agent $id (list it in --control-plane-agent-ids)"); done
  made+=("node-client-ca.crt/.key  proxy-server --node-client-ca-cert")
  for node in "${nodes[@]}"; do made+=("node-$node.crt/.key  node agent of $node: --node-client-cert/--node-client-key"); done
  report "$(pwd)" "${made[@]}"
}

case ${1:-} in
  "" | -h | --help) usage ;;
  --cluster) shift; cluster "$@" ;;
  *) (($# == 1)) || usage; demo "$1" ;;
esac
