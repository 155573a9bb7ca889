#!/usr/bin/env bash
# A local demo of the egress tunnel on loopback, in both of kube-apiserver's modes:
#   curl --proxy https://127.0.0.1:$FRONTEND_PORT (HTTP CONNECT, mTLS) → proxy-server → proxy-agent (mTLS) → web page
#   proxy-test-client (gRPC over a Unix socket)   → proxy-server → proxy-agent (mTLS) → web page
#   Python grpcio (gRPC over the Unix socket, with the :authority grpc-go and
#   so kube-apiserver send there: the percent-encoded socket path) → the same
# Builds the binaries, makes throwaway certificates, starts a web server,
# proxy-server and proxy-agent, fetches the page through the tunnel and
# stops everything again. Run as root on Debian: bash hack/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/lib/build-tools.sh
require_build_tools hack/demo.sh

FRONTEND_PORT=${FRONTEND_PORT:-18090}
AGENT_PORT=${AGENT_PORT:-18091}
SERVER_HEALTH_PORT=${SERVER_HEALTH_PORT:-18092}
AGENT_HEALTH_PORT=${AGENT_HEALTH_PORT:-18093}
WEB_PORT=${WEB_PORT:-18080}
GRPC_AGENT_PORT=${GRPC_AGENT_PORT:-18191}
GRPC_SERVER_HEALTH_PORT=${GRPC_SERVER_HEALTH_PORT:-18192}
GRPC_AGENT_HEALTH_PORT=${GRPC_AGENT_HEALTH_PORT:-18193}

need=()
for tool in curl openssl python3; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# grpcio for the gRPC client that is not ours, in a virtual environment of
# the project's (hack/.venv), never in the system Python.
source hack/lib/python.sh
python_venv 'grpc:grpcio>=1.60,<2'

echo "== building (the first build takes a few minutes)"
cargo build --bins --locked
bin=target/debug

work=hack/.demo
rm -rf "$work"
mkdir -p "$work/www"
hack/gen-certs.sh "$work/certs"
certs=$work/certs
echo "Hello from behind the agent: this page came through konnectivity-rs." > "$work/www/index.html"

pids=()
# proxy-agent drains on its first SIGTERM and exits on the second, as upstream's.
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 0.2
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

(cd "$work/www" && exec python3 -m http.server "$WEB_PORT" --bind 127.0.0.1) >"$work/web.log" 2>&1 &
pids+=($!)

"$bin/proxy-server" --mode=http-connect \
  --server-port="$FRONTEND_PORT" --server-bind-address=127.0.0.1 \
  --server-cert="$certs/server.crt" --server-key="$certs/server.key" --server-ca-cert="$certs/ca.crt" \
  --agent-port="$AGENT_PORT" --agent-bind-address=127.0.0.1 \
  --cluster-cert="$certs/server.crt" --cluster-key="$certs/server.key" --cluster-ca-cert="$certs/ca.crt" \
  --health-port="$SERVER_HEALTH_PORT" --health-bind-address=127.0.0.1 >"$work/server.log" 2>&1 &
pids+=($!)

"$bin/proxy-agent" --proxy-server-host=127.0.0.1 --proxy-server-port="$AGENT_PORT" \
  --ca-cert="$certs/ca.crt" --agent-cert="$certs/agent.crt" --agent-key="$certs/agent.key" \
  --agent-id=demo-agent --health-server-port="$AGENT_HEALTH_PORT" --health-server-host=127.0.0.1 >"$work/agent.log" 2>&1 &
pids+=($!)

# A second pair in gRPC mode, its frontend on a Unix socket as beside kube-apiserver.
"$bin/proxy-server" --mode=grpc --uds-name="$work/konnectivity-server.socket" --server-port=0 \
  --agent-port="$GRPC_AGENT_PORT" --agent-bind-address=127.0.0.1 \
  --cluster-cert="$certs/server.crt" --cluster-key="$certs/server.key" --cluster-ca-cert="$certs/ca.crt" \
  --health-port="$GRPC_SERVER_HEALTH_PORT" --health-bind-address=127.0.0.1 >"$work/grpc-server.log" 2>&1 &
pids+=($!)
"$bin/proxy-agent" --proxy-server-host=127.0.0.1 --proxy-server-port="$GRPC_AGENT_PORT" \
  --ca-cert="$certs/ca.crt" --agent-cert="$certs/agent.crt" --agent-key="$certs/agent.key" \
  --agent-id=demo-grpc-agent --health-server-port="$GRPC_AGENT_HEALTH_PORT" --health-server-host=127.0.0.1 >"$work/grpc-agent.log" 2>&1 &
pids+=($!)

echo "== waiting for the web server and for the agents to connect"
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$WEB_PORT/" >/dev/null \
    && curl -sf "http://127.0.0.1:$SERVER_HEALTH_PORT/readyz" >/dev/null \
    && curl -sf "http://127.0.0.1:$GRPC_SERVER_HEALTH_PORT/readyz" >/dev/null && break
  sleep 0.1
done
curl -sS "http://127.0.0.1:$SERVER_HEALTH_PORT/readyz"

echo "== curl through the tunnel (HTTP CONNECT over mTLS)"
curl -sS --fail --proxytunnel --proxy "https://127.0.0.1:$FRONTEND_PORT" \
  --proxy-cacert "$certs/ca.crt" --proxy-cert "$certs/client.crt" --proxy-key "$certs/client.key" \
  "http://127.0.0.1:$WEB_PORT/index.html"

echo "== proxy-test-client through the tunnel (gRPC ProxyService over the Unix socket)"
"$bin/proxy-test-client" --mode=grpc --proxy-uds="$work/konnectivity-server.socket" \
  --request-host=127.0.0.1 --request-port="$WEB_PORT" --request-path=/index.html | tail -n 1

echo "== Python grpcio through the tunnel (gRPC over the Unix socket, :authority = the percent-encoded socket path)"
python3 hack/grpc-dial.py "$PWD/$work/konnectivity-server.socket" "127.0.0.1:$WEB_PORT" /index.html

echo "== server metrics after the request"
curl -sS "http://127.0.0.1:$SERVER_HEALTH_PORT/metrics" | grep -E '^konnectivity_network_proxy_server_(established_connections|ready_backends|stream_packets_total\{segment="from_agent",packet_type="DATA"\}) '
echo "== demo done (logs in $work; the binaries in $bin: README's \"Running it\" runs them by hand)"
