#!/usr/bin/env bash
# Makes throwaway certificates for a local demo or test run:
#   ca.{crt,key}        one CA for every identity (a demo; production splits CAs)
#   server.{crt,key}    proxy-server (frontend and agent listener), SANs localhost/127.0.0.1/::1
#   agent.{crt,key}     proxy-agent client certificate
#   client.{crt,key}    frontend client certificate (what kube-apiserver presents)
# Usage: hack/gen-certs.sh DIR
set -euo pipefail
dir=${1:?usage: gen-certs.sh DIR}
mkdir -p "$dir"
cd "$dir"

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj "/CN=konnectivity-demo-ca" -keyout ca.key -out ca.crt 2>/dev/null

issue() { # name, subject CN, extensions
  local name=$1 cn=$2 ext=$3
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=$cn" -keyout "$name.key" -out "$name.csr" 2>/dev/null
  printf '%s\n' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

issue server proxy-server "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
extendedKeyUsage=serverAuth"
issue agent proxy-agent "extendedKeyUsage=clientAuth"
issue client kube-apiserver "extendedKeyUsage=clientAuth"
chmod 600 ./*.key
