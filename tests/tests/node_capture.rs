//! Node → kube-apiserver, transparently, in network namespaces (root).
//!
//! ```text
//!  [node netns] 10.222.0.1 ──veth── 10.222.0.2 [control-plane netns]
//!   curl/kubectl → 10.96.0.1:443                proxy-server (agent port, node frontend)
//!   nft REDIRECT → node proxy-agent :15443      control-plane proxy-agent (cp-1)
//!   (no route to 10.222.1.10)                   nginx "kube-apiserver" on 10.222.1.10:6443 (lo)
//! ```

mod support;

use std::path::PathBuf;
use std::time::Duration;

use sha2::{Digest, Sha256};
use support::certs::Pki;
use support::netns::{Netns, link, root_or_skip};
use support::procs::Proc;
use support::{Pattern, TempDir, wait_until};

const VIP: &str = "10.96.0.1";
const VIP6: &str = "fd00:96::1";
const KAS: &str = "10.222.1.10:6443";
const SERVER_IP: &str = "10.222.0.2";
const AGENT_PORT: u16 = 8091;
const NODE_FRONTEND_PORT: u16 = 8096;
const SERVER_HEALTH: u16 = 8092;
const CP_AGENT_HEALTH: u16 = 8093;
const NODE_AGENT_HEALTH: u16 = 8094;
const VERSION_BODY: &str = r#"{"major":"1","minor":"31","gitVersion":"v1.31.0-konnectivity-standin"}"#;
const BLOB_LEN: usize = 200 * 1024 * 1024;

struct Topology {
    dir: TempDir,
    pki: Pki,
    node: Netns,
    /// Held so the namespace lives as long as the topology.
    _control_plane: Netns,
    _nginx: Proc,
    _server: Proc,
    _cp_agent: Proc,
    blob_sha256: String,
}

fn write_nginx_config(dir: &std::path::Path, pki: &Pki) -> PathBuf {
    let www = dir.join("www");
    std::fs::create_dir_all(www.join("files")).unwrap();
    let config = format!(
        r#"daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/nginx-body;
    proxy_temp_path {dir}/nginx-proxy;
    fastcgi_temp_path {dir}/nginx-fastcgi;
    uwsgi_temp_path {dir}/nginx-uwsgi;
    scgi_temp_path {dir}/nginx-scgi;
    server {{
        listen {KAS} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location = /version {{ default_type application/json; return 200 '{VERSION_BODY}'; }}
        location = /healthz {{ default_type text/plain; return 200 'ok'; }}
        location /files/ {{ alias {www}/files/; }}
    }}
}}
"#,
        dir = dir.display(),
        cert = pki.kas.cert.display(),
        key = pki.kas.key.display(),
        www = www.display(),
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, config).unwrap();
    path
}

/// A 200 MiB file for nginx to serve, and its SHA-256.
fn write_blob(dir: &std::path::Path) -> String {
    let mut data = vec![0u8; BLOB_LEN];
    Pattern::new(42).fill(&mut data);
    std::fs::write(dir.join("www/files/blob"), &data).unwrap();
    format!("{:x}", Sha256::digest(&data))
}

fn node_agent_args(pki: &Pki, extra_captures: &[String]) -> Vec<String> {
    let mut args = vec![
        format!("--proxy-server-host={SERVER_IP}"),
        format!("--proxy-server-port={AGENT_PORT}"),
        format!("--ca-cert={}", pki.ca.display()),
        format!("--agent-cert={}", pki.agent.cert.display()),
        format!("--agent-key={}", pki.agent.key.display()),
        "--agent-id=node-1".to_owned(),
        format!("--health-server-port={NODE_AGENT_HEALTH}"),
        "--sync-interval=100ms".to_owned(),
        "--sync-interval-cap=500ms".to_owned(),
        format!("--capture={VIP}:443={KAS}"),
        format!("--capture=[{VIP6}]:443={KAS}"),
        format!("--node-frontend-port={NODE_FRONTEND_PORT}"),
        format!("--node-client-cert={}", pki.node_client.cert.display()),
        format!("--node-client-key={}", pki.node_client.key.display()),
    ];
    args.extend(extra_captures.iter().cloned());
    args
}

async fn build() -> Topology {
    let dir = TempDir::new("konn-capture");
    let pki = Pki::new(dir.path());
    let node = Netns::new("node");
    let control_plane = Netns::new("cp");
    link(&node, "10.222.0.1/24", &control_plane, "10.222.0.2/24");
    // The VIP is routable from the node (as kube-proxy's service range is);
    // the API server's private address is not.
    node.ip(&["route", "add", "10.96.0.0/12", "dev", "veth0"]);
    node.ip(&["addr", "add", "fd00:222::1/64", "dev", "veth0", "nodad"]);
    control_plane.ip(&["addr", "add", "fd00:222::2/64", "dev", "veth0", "nodad"]);
    node.ip(&["-6", "route", "add", "fd00:96::/108", "dev", "veth0"]);
    control_plane.ip(&["addr", "add", "10.222.1.10/32", "dev", "lo"]);

    let nginx_config = write_nginx_config(dir.path(), &pki);
    let blob_sha256 = write_blob(dir.path());
    let nginx = control_plane.spawn_program(
        "nginx",
        &[
            "-c".to_owned(),
            nginx_config.display().to_string(),
            "-p".to_owned(),
            dir.path().display().to_string(),
        ],
        dir.path(),
    );
    let server = control_plane.spawn(
        "proxy-server",
        &[
            "--mode=grpc".to_owned(),
            format!("--uds-name={}", dir.path().join("kas-egress.sock").display()),
            "--server-port=0".to_owned(),
            format!("--agent-port={AGENT_PORT}"),
            format!("--health-port={SERVER_HEALTH}"),
            format!("--cluster-cert={}", pki.server.cert.display()),
            format!("--cluster-key={}", pki.server.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
            format!("--node-frontend-port={NODE_FRONTEND_PORT}"),
            format!("--node-client-ca-cert={}", pki.node_ca.display()),
            format!("--node-allowed-destinations={KAS}"),
            "--control-plane-agent-ids=cp-1".to_owned(),
        ],
        dir.path(),
    );
    let cp_agent = control_plane.spawn(
        "proxy-agent",
        &[
            format!("--proxy-server-host={SERVER_IP}"),
            format!("--proxy-server-port={AGENT_PORT}"),
            format!("--ca-cert={}", pki.ca.display()),
            format!("--agent-cert={}", pki.control_plane_agent.cert.display()),
            format!("--agent-key={}", pki.control_plane_agent.key.display()),
            "--agent-id=cp-1".to_owned(),
            format!("--health-server-port={CP_AGENT_HEALTH}"),
            "--sync-interval=100ms".to_owned(),
            "--sync-interval-cap=500ms".to_owned(),
        ],
        dir.path(),
    );
    let cp = &control_plane;
    wait_until(
        Duration::from_secs(15),
        "the control-plane agent to connect",
        || async { cp.http_get(CP_AGENT_HEALTH, "/readyz").0 == 200 },
    )
    .await;
    Topology {
        dir,
        pki,
        node,
        _control_plane: control_plane,
        _nginx: nginx,
        _server: server,
        _cp_agent: cp_agent,
        blob_sha256,
    }
}

impl Topology {
    fn start_node_agent(&self, extra_captures: &[String]) -> Proc {
        self.node.spawn(
            "proxy-agent",
            &node_agent_args(&self.pki, extra_captures),
            self.dir.path(),
        )
    }

    async fn wait_node_ready(&self) {
        let node = &self.node;
        wait_until(Duration::from_secs(15), "the node agent to be ready", || async {
            node.http_get(NODE_AGENT_HEALTH, "/readyz").0 == 200
        })
        .await;
    }

    /// curl inside the node namespace, as a host process would run it.
    fn curl(&self, args: &str) -> std::process::Output {
        self.node.sh(&format!(
            "curl -sS --max-time 20 --cacert {} {args}",
            self.pki.ca.display()
        ))
    }

    fn version_through_vip(&self) -> std::process::Output {
        self.curl(&format!("https://{VIP}/version"))
    }

    fn has_table(&self) -> bool {
        let output = self.node.sh("nft list tables");
        String::from_utf8_lossy(&output.stdout).contains("konnectivity")
    }
}

fn text(output: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_processes_reach_the_private_api_server_through_the_vip() {
    if !root_or_skip("node_processes_reach_the_private_api_server_through_the_vip") {
        return;
    }
    let topology = build().await;
    // Without the tunnel, the node has no way to the API server's address.
    let direct = topology.curl(&format!("https://{KAS}/version"));
    assert!(
        !direct.status.success(),
        "the node must not reach {KAS} directly: {}",
        text(&direct)
    );

    // The node agent also captures its own server address (as a cluster might
    // route the server through a captured VIP): its own sockets carry the mark,
    // so they must never be captured, or the tunnel would loop into itself.
    let loop_guard = format!("--capture={SERVER_IP}:{NODE_FRONTEND_PORT}={KAS}");
    let _agent = topology.start_node_agent(&[loop_guard]);
    topology.wait_node_ready().await;
    assert!(topology.has_table());

    // curl with the API server's CA: TLS is end to end, so this verifies
    // nginx's certificate (SAN 10.96.0.1) through the tunnel.
    let version = topology.curl(&format!("-v https://{VIP}/version"));
    assert!(version.status.success(), "{}", text(&version));
    assert_eq!(String::from_utf8_lossy(&version.stdout), VERSION_BODY);
    assert!(
        String::from_utf8_lossy(&version.stderr).contains("CN=kube-apiserver-standin"),
        "the certificate seen must be the API server's: {}",
        text(&version)
    );

    // kubectl with a kubeconfig as a node has it: the server is the VIP
    // (with a token, so kubectl does not prompt for a password).
    let kubeconfig = topology.dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: kind\n  cluster:\n    server: https://{VIP}\n    \
             certificate-authority: {}\ncontexts:\n- name: node\n  context:\n    cluster: kind\n    user: node\n\
             current-context: node\nusers:\n- name: node\n  user:\n    token: node-bootstrap-token\n",
            topology.pki.ca.display()
        ),
    )
    .unwrap();
    let kubectl = topology.node.sh(&format!(
        "kubectl --kubeconfig {} get --raw /version",
        kubeconfig.display()
    ));
    assert!(kubectl.status.success(), "{}", text(&kubectl));
    assert!(String::from_utf8_lossy(&kubectl.stdout).contains("v1.31.0-konnectivity-standin"));

    // 200 MiB through the captured path, checksummed inside the node.
    let download = topology.curl(&format!("https://{VIP}/files/blob | sha256sum"));
    assert!(download.status.success(), "{}", text(&download));
    assert!(
        String::from_utf8_lossy(&download.stdout).starts_with(&topology.blob_sha256),
        "200 MiB arrived changed: {}",
        text(&download)
    );

    // 200 concurrent captured connections, each answered correctly.
    let urls: String = (0..200)
        .map(|i| format!(" https://{VIP}/version?n={i}"))
        .collect();
    let parallel = topology.curl(&format!(
        "--parallel --parallel-max 200 --parallel-immediate{urls}"
    ));
    assert!(parallel.status.success(), "{}", text(&parallel));
    let bodies = String::from_utf8_lossy(&parallel.stdout)
        .matches(VERSION_BODY)
        .count();
    assert_eq!(bodies, 200, "{}", text(&parallel));

    // The IPv6 service VIP is captured the same way (SO_ORIGINAL_DST v6).
    let v6 = topology.curl(&format!("-g https://[{VIP6}]/version"));
    assert!(v6.status.success(), "{}", text(&v6));
    assert_eq!(String::from_utf8_lossy(&v6.stdout), VERSION_BODY);

    // A connection redirected to the listener for a destination that is not
    // in the capture map is closed and counted, never forwarded.
    let stray = topology
        .node
        .sh("nft add rule inet konnectivity output ip daddr 10.96.0.2 tcp dport 443 redirect to :15443");
    assert!(stray.status.success(), "{}", text(&stray));
    let refused = topology.curl("https://10.96.0.2/version");
    assert!(!refused.status.success(), "{}", text(&refused));
    let unknown = topology.node.metric(
        NODE_AGENT_HEALTH,
        "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"unknown_destination\"}",
    );
    assert_eq!(unknown, Some(1.0));

    let tunneled = topology.node.metric(
        NODE_AGENT_HEALTH,
        "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"tunneled\"}",
    );
    assert!(tunneled.unwrap_or(0.0) >= 204.0, "tunneled {tunneled:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_resumes_capturing_and_a_clean_shutdown_removes_the_rules() {
    if !root_or_skip("a_restarted_agent_resumes_capturing_and_a_clean_shutdown_removes_the_rules") {
        return;
    }
    let topology = build().await;
    let mut agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    assert!(topology.version_through_vip().status.success());

    // A crash leaves the rules in place: clients fail fast (reset) meanwhile.
    agent.kill();
    assert!(topology.has_table(), "rules must survive a crash");
    let during = topology.version_through_vip();
    assert!(!during.status.success(), "no agent, no answer: {}", text(&during));

    let mut agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    let after = topology.version_through_vip();
    assert!(after.status.success(), "{}", text(&after));
    assert_eq!(String::from_utf8_lossy(&after.stdout), VERSION_BODY);

    // Two SIGTERMs (drain, then exit) end it cleanly and take the table away.
    agent.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.signal("TERM");
    assert!(
        agent.wait_exit(Duration::from_secs(5)).await.is_some(),
        "agent did not exit"
    );
    assert!(
        !topology.has_table(),
        "a clean shutdown must remove the konnectivity table"
    );
}
