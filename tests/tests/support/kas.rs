//! The node → kube-apiserver topology in network namespaces, shared by the
//! host and pod capture tests (root).
//!
//! ```text
//!  [node netns] 10.222.0.1 ──veth── 10.222.0.2 [control-plane netns]
//!   curl/kubectl → 10.96.0.1:443                proxy-server (agent port, node frontend)
//!   nft REDIRECT → node proxy-agent :15443      control-plane proxy-agent (cp-1)
//!   (no route to 10.222.1.10)                   nginx "kube-apiserver" on 10.222.1.10:6443 (lo)
//! ```

#![allow(dead_code)]
use std::path::PathBuf;
use std::time::Duration;

use super::balancer::RoundRobin;
use super::certs::Pki;
use super::image::Binaries;
use super::netns::{Netns, link};
use super::procs::{Proc, agent_args};
use super::{Pattern, TempDir, wait_until};
use sha2::{Digest, Sha256};

pub const VIP: &str = "10.96.0.1";
pub const VIP6: &str = "fd00:96::1";
pub const KAS: &str = "10.222.1.10:6443";
/// A destination beside the API server, allowed to node clients, that a
/// test serves itself (long-lived streams the API server stand-in cannot
/// make); node agents capture it with [`STREAMS_CAPTURE`].
pub const STREAMS: &str = "10.222.1.10:7000";
/// Where node clients reach [`STREAMS`]: the VIP's address, another port.
pub const STREAMS_VIP: &str = "10.96.0.1:7000";
pub const STREAMS_CAPTURE: &str = "--capture=10.96.0.1:7000=10.222.1.10:7000";
pub const SERVER_IP: &str = "10.222.0.2";
pub const AGENT_PORT: u16 = 8091;
pub const NODE_FRONTEND_PORT: u16 = 8096;
pub const SERVER_HEALTH: u16 = 8092;
pub const CP_AGENT_HEALTH: u16 = 8093;
pub const NODE_AGENT_HEALTH: u16 = 8094;
/// The node agent's admin listener (/metrics), in the node's namespace.
pub const NODE_AGENT_ADMIN: u16 = 8095;
pub const VERSION_BODY: &str = r#"{"major":"1","minor":"31","gitVersion":"v1.31.0-konnectivity-standin"}"#;
pub const BLOB_LEN: usize = 200 * 1024 * 1024;

pub struct Topology {
    pub dir: TempDir,
    pub pki: Pki,
    /// Where proxy-server and both agents come from.
    pub binaries: Binaries,
    pub node: Netns,
    /// proxy-server, the control-plane agent and the API server stand-in.
    pub control_plane: Netns,
    _nginx: Proc,
    /// One, or several behind [`Topology::balancers`].
    _servers: Vec<Proc>,
    _cp_agent: Proc,
    /// With several servers behind one address: at [`SERVER_IP`], the agent
    /// port's and the node frontend's.
    balancers: Vec<RoundRobin>,
    /// The agents' `--proxy-server-host`: [`SERVER_IP`], or every server's
    /// own address when they are listed without a balancer.
    server_hosts: String,
    pub blob_sha256: String,
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

pub fn node_agent_args(pki: &Pki, extra_captures: &[String]) -> Vec<String> {
    let server = (SERVER_IP, AGENT_PORT);
    let mut args = agent_args(server, pki, &pki.agent, "node-1", NODE_AGENT_HEALTH);
    args.extend([
        format!("--admin-server-port={NODE_AGENT_ADMIN}"),
        format!("--capture={VIP}:443={KAS}"),
        format!("--capture=[{VIP6}]:443={KAS}"),
        format!("--node-frontend-port={NODE_FRONTEND_PORT}"),
        format!("--node-client-cert={}", pki.node_client.cert.display()),
        format!("--node-client-key={}", pki.node_client.key.display()),
    ]);
    args.extend(extra_captures.iter().cloned());
    args
}

/// Builds the topology with this build's binaries; `blob` also writes the
/// 200 MiB file for nginx.
pub async fn build(blob: bool) -> Topology {
    build_from(blob, Binaries::Build).await
}

/// [`build`], with proxy-server and the agents from `binaries`.
pub async fn build_from(blob: bool, binaries: Binaries) -> Topology {
    build_with(blob, binaries, 1, Front::Balancer).await
}

/// The address of the `n`th of several servers (on the control plane's
/// loopback, as each server of an HA control plane has its own).
pub fn server_ip(n: usize) -> String {
    format!("10.222.1.{}", 21 + n)
}

/// The health port of the `n`th of several servers.
pub fn server_health(n: usize) -> u16 {
    SERVER_HEALTH + 100 * n as u16
}

/// [`build`] with `servers` proxy-servers (ids `server-0`, …) behind one
/// address, [`SERVER_IP`]: a round-robin balancer for the agent port and
/// one for the node frontend, as an HA control plane puts a load balancer
/// before its servers. The control-plane agent holds a stream to each.
pub async fn build_behind_balancer(servers: usize) -> Topology {
    build_with(false, Binaries::Build, servers, Front::Balancer).await
}

/// [`build`] with `servers` proxy-servers (ids `server-0`, …), each on its
/// own address ([`server_ip`]), which the agents list in
/// `--proxy-server-host`: an HA control plane without a balancer.
pub async fn build_listed(servers: usize) -> Topology {
    build_with(false, Binaries::Build, servers, Front::Listed).await
}

/// How agents reach several servers.
#[derive(Clone, Copy, PartialEq)]
enum Front {
    /// One address, a round-robin balancer's.
    Balancer,
    /// Every server's own address, in `--proxy-server-host`.
    Listed,
}

async fn build_with(blob: bool, binaries: Binaries, servers: usize, front: Front) -> Topology {
    let dir = TempDir::new("konn-capture");
    let pki = Pki::new(dir.path());
    let node = Netns::new("node");
    let control_plane = Netns::new("cp");
    link(&node, "10.222.0.1/24", &control_plane, "10.222.0.2/24");
    // The VIP is routable from the node (as kube-proxy's service range is);
    // the API server's private address is not.
    node.ip(&["route", "add", "10.96.0.0/12", "dev", "veth0"]);
    // A default route that leads nowhere (a gateway no one answers for), as
    // a node's route to the outside does for a private endpoint: connect()
    // to 10.222.1.10 passes routing (so an eBPF-rewritten connection reaches
    // the output hook, as it does on a real node) and its packets vanish
    // unless captured.
    node.ip(&["route", "add", "default", "via", "10.222.0.254", "dev", "veth0"]);
    node.ip(&["addr", "add", "fd00:222::1/64", "dev", "veth0", "nodad"]);
    control_plane.ip(&["addr", "add", "fd00:222::2/64", "dev", "veth0", "nodad"]);
    node.ip(&["-6", "route", "add", "fd00:96::/108", "dev", "veth0"]);
    control_plane.ip(&["addr", "add", "10.222.1.10/32", "dev", "lo"]);

    let nginx_config = write_nginx_config(dir.path(), &pki);
    let blob_sha256 = if blob {
        write_blob(dir.path())
    } else {
        String::new()
    };
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
    let server_args = |socket: &str| {
        vec![
            "--mode=grpc".to_owned(),
            format!("--uds-name={}", dir.path().join(socket).display()),
            "--server-port=0".to_owned(),
            format!("--agent-port={AGENT_PORT}"),
            format!("--cluster-cert={}", pki.server.cert.display()),
            format!("--cluster-key={}", pki.server.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
            format!("--node-frontend-port={NODE_FRONTEND_PORT}"),
            format!("--node-client-ca-cert={}", pki.node_ca.display()),
            format!("--node-allowed-destinations={KAS},{STREAMS}"),
            "--control-plane-agent-ids=cp-1".to_owned(),
        ]
    };
    let mut balancers = Vec::new();
    let server_procs = if servers == 1 {
        let mut args = server_args("kas-egress.sock");
        args.push(format!("--health-port={SERVER_HEALTH}"));
        vec![control_plane.spawn_from(&binaries, "proxy-server", &args, dir.path())]
    } else {
        let mut procs = Vec::new();
        for n in 0..servers {
            let ip = server_ip(n);
            control_plane.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"]);
            let mut args = server_args(&format!("kas-egress-{n}.sock"));
            args.extend([
                format!("--server-id=server-{n}"),
                format!("--server-count={servers}"),
                format!("--agent-bind-address={ip}"),
                format!("--node-frontend-bind-address={ip}"),
                format!("--health-port={}", server_health(n)),
                format!("--admin-port={}", server_health(n) + 50),
            ]);
            procs.push(control_plane.spawn_from(&binaries, "proxy-server", &args, dir.path()));
        }
        let ports = match front {
            Front::Balancer => [AGENT_PORT, NODE_FRONTEND_PORT].as_slice(),
            Front::Listed => &[],
        };
        for port in ports {
            let backends = (0..servers)
                .map(|n| format!("{}:{port}", server_ip(n)).parse().unwrap())
                .collect();
            balancers.push(RoundRobin::start_in(
                &control_plane,
                &format!("{SERVER_IP}:{port}"),
                backends,
            ));
        }
        procs
    };
    let server_hosts = if servers > 1 && front == Front::Listed {
        for n in 0..servers {
            // The node reaches each server's own address (only those: the
            // API server's stays unroutable).
            node.ip(&[
                "route",
                "add",
                &format!("{}/32", server_ip(n)),
                "via",
                "10.222.0.2",
            ]);
        }
        (0..servers).map(server_ip).collect::<Vec<_>>().join(",")
    } else {
        SERVER_IP.to_owned()
    };
    let cp_agent = control_plane.spawn_from(
        &binaries,
        "proxy-agent",
        &agent_args(
            (&server_hosts, AGENT_PORT),
            &pki,
            &pki.control_plane_agent,
            "cp-1",
            CP_AGENT_HEALTH,
        ),
        dir.path(),
    );
    let cp = &control_plane;
    wait_until(
        Duration::from_secs(15),
        "the control-plane agent to connect",
        || async { cp.http_get(CP_AGENT_HEALTH, "/readyz").0 == 200 },
    )
    .await;
    if servers > 1 {
        wait_until(
            Duration::from_secs(30),
            "the control-plane agent to hold a stream to every server",
            || async {
                (0..servers).all(|n| {
                    cp.metric(
                        server_health(n),
                        "konnectivity_network_proxy_server_ready_backend_connections",
                    )
                    .unwrap_or(0.0)
                        >= 1.0
                })
            },
        )
        .await;
    }
    Topology {
        dir,
        pki,
        binaries,
        node,
        control_plane,
        _nginx: nginx,
        _servers: server_procs,
        _cp_agent: cp_agent,
        balancers,
        server_hosts,
        blob_sha256,
    }
}

impl Topology {
    /// Kills the `n`th of several servers (SIGKILL), as a crash does.
    pub fn kill_server(&mut self, n: usize) {
        self._servers[n].kill();
    }

    /// The node agent with `extra` flags. Its hand-over socket is the
    /// test's own: on the machine's, agents of other tests would hand their
    /// roles to each other.
    pub fn start_node_agent(&self, extra: &[String]) -> Proc {
        let mut args = node_agent_args(&self.pki, &[]);
        for arg in &mut args {
            if arg.starts_with("--proxy-server-host=") {
                *arg = format!("--proxy-server-host={}", self.server_hosts);
            }
        }
        args.push(format!(
            "--handover-socket={}",
            self.dir.path().join("handover.sock").display()
        ));
        args.extend(extra.iter().cloned());
        self.node
            .spawn_from(&self.binaries, "proxy-agent", &args, self.dir.path())
    }

    pub async fn wait_node_ready(&self) {
        let node = &self.node;
        wait_until(Duration::from_secs(15), "the node agent to be ready", || async {
            node.http_get(NODE_AGENT_HEALTH, "/readyz").0 == 200
        })
        .await;
    }

    /// curl inside the node namespace, as a host process would run it.
    pub fn curl(&self, args: &str) -> std::process::Output {
        self.node.sh(&format!(
            "curl -sS --max-time 20 --cacert {} {args}",
            self.pki.ca.display()
        ))
    }

    /// `kubectl get --raw PATH` inside `netns`, with a kubeconfig as a node
    /// or a pod has it: the server is the VIP, TLS checked against the API
    /// server's CA (with a token, so kubectl does not prompt for a password).
    pub fn kubectl_get_raw(&self, netns: &Netns, path: &str) -> std::process::Output {
        let kubeconfig = self.dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text(&self.pki.ca.display().to_string())).unwrap();
        netns.sh(&format!(
            "kubectl --kubeconfig {} --request-timeout 20s get --raw {path}",
            kubeconfig.display()
        ))
    }

    pub fn version_through_vip(&self) -> std::process::Output {
        self.curl(&format!("https://{VIP}/version"))
    }

    pub fn has_table(&self) -> bool {
        let output = self.node.sh("nft list tables");
        String::from_utf8_lossy(&output.stdout).contains("konnectivity")
    }
}

/// A kubeconfig as a node or a pod has it: the server is the VIP, checked
/// against the API server's CA at `ca` (with a token, so kubectl does not
/// prompt for a password).
pub fn kubeconfig_text(ca: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kind\n  cluster:\n    server: https://{VIP}\n    \
         certificate-authority: {ca}\ncontexts:\n- name: node\n  context:\n    cluster: kind\n    user: node\n\
         current-context: node\nusers:\n- name: node\n  user:\n    token: node-bootstrap-token\n"
    )
}

pub fn text(output: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}
