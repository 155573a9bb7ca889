//! Where kube-apiserver is and how to prove who we are to it: from a
//! kubeconfig file (`--kubeconfig`) or, inside a pod, from the
//! ServiceAccount Kubernetes mounts there.
//!
//! Only what a server-side component needs is supported: a token, a token
//! file or a client certificate, and a CA. Anything else (exec plugins,
//! auth providers, basic auth, skipping TLS verification) is refused with an
//! error naming the field, rather than silently connecting without it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

/// Where a pod finds its ServiceAccount's credentials.
const IN_CLUSTER_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

#[derive(Debug, thiserror::Error)]
pub enum KubeConfigError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("kubeconfig {path}: {problem}")]
    Invalid { path: PathBuf, problem: String },
    #[error(
        "no --kubeconfig given and not running in a pod (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are unset)"
    )]
    NotInCluster,
}

/// How requests prove who we are, besides a client certificate in the TLS
/// configuration. Its `Debug` names the kind, never the token: a debug
/// line or a panic message must not leak it.
#[derive(Clone)]
pub enum Credentials {
    None,
    Token(String),
    /// Read before every request: projected tokens are rotated on disk.
    TokenFile(PathBuf),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::None => f.write_str("None"),
            Credentials::Token(_) => f.write_str("Token(<redacted>)"),
            Credentials::TokenFile(path) => f.debug_tuple("TokenFile").field(path).finish(),
        }
    }
}

/// A kube-apiserver endpoint and our credentials for it.
#[derive(Clone)]
pub struct KubeEndpoint {
    /// `https://host:port` plus any path prefix, without a trailing slash.
    pub server: String,
    pub host: String,
    pub port: u16,
    pub path_prefix: String,
    /// The name the server's certificate must carry.
    pub server_name: String,
    pub tls: Arc<ClientConfig>,
    pub credentials: Credentials,
    /// Requests wait for this limit's turn (`--kubeconfig-qps`,
    /// `--kubeconfig-burst`); one limit shared by every client of the
    /// binary. `None`: no limit.
    pub rate_limit: Option<Arc<crate::rate::RateLimit>>,
}

#[derive(Deserialize)]
struct Kubeconfig {
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    users: Vec<NamedUser>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
    #[serde(rename = "current-context", default)]
    current_context: String,
}

#[derive(Deserialize)]
struct NamedCluster {
    name: String,
    cluster: Cluster,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Cluster {
    server: String,
    certificate_authority: Option<String>,
    certificate_authority_data: Option<String>,
    #[serde(default)]
    insecure_skip_tls_verify: bool,
    tls_server_name: Option<String>,
}

#[derive(Deserialize)]
struct NamedUser {
    name: String,
    #[serde(default)]
    user: User,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
struct User {
    token: Option<String>,
    #[serde(rename = "tokenFile")]
    token_file: Option<String>,
    client_certificate: Option<String>,
    client_certificate_data: Option<String>,
    client_key: Option<String>,
    client_key_data: Option<String>,
    exec: Option<serde_yaml_ng::Value>,
    auth_provider: Option<serde_yaml_ng::Value>,
    username: Option<String>,
}

#[derive(Deserialize)]
struct NamedContext {
    name: String,
    context: Context,
}

#[derive(Deserialize)]
struct Context {
    cluster: String,
    #[serde(default)]
    user: String,
}

/// The server and how we authenticate; rustls' configuration says little
/// and fills a screen.
impl std::fmt::Debug for KubeEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEndpoint")
            .field("server", &self.server)
            .field("server_name", &self.server_name)
            .field("credentials", &self.credentials)
            .field("rate_limit", &self.rate_limit)
            .finish_non_exhaustive()
    }
}

impl KubeEndpoint {
    /// From `--kubeconfig`, or the pod's ServiceAccount when it is empty
    /// (as upstream does).
    pub fn from_flag(kubeconfig: &str) -> Result<KubeEndpoint, KubeConfigError> {
        if kubeconfig.is_empty() {
            KubeEndpoint::in_cluster()
        } else {
            KubeEndpoint::from_kubeconfig(Path::new(kubeconfig))
        }
    }

    /// The endpoint of `--kubeconfig`'s current context.
    pub fn from_kubeconfig(path: &Path) -> Result<KubeEndpoint, KubeConfigError> {
        let invalid = |problem: String| KubeConfigError::Invalid {
            path: path.to_owned(),
            problem,
        };
        let text = std::fs::read_to_string(path).map_err(|source| KubeConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config: Kubeconfig = serde_yaml_ng::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        // Relative file names in a kubeconfig are relative to its directory.
        let dir = path.parent().unwrap_or(Path::new("."));
        let resolve = |name: &str| dir.join(name);

        let context = match config.contexts.as_slice() {
            [only] if config.current_context.is_empty() => &only.context,
            contexts => {
                &contexts
                    .iter()
                    .find(|c| c.name == config.current_context)
                    .ok_or_else(|| {
                        invalid(format!(
                            "current-context {:?} names no entry of contexts",
                            config.current_context
                        ))
                    })?
                    .context
            }
        };
        let cluster = &config
            .clusters
            .iter()
            .find(|c| c.name == context.cluster)
            .ok_or_else(|| {
                invalid(format!(
                    "context's cluster {:?} names no entry of clusters",
                    context.cluster
                ))
            })?
            .cluster;
        let user = match context.user.as_str() {
            "" => User::default(),
            name => {
                let found = config.users.into_iter().find(|u| u.name == name);
                found
                    .ok_or_else(|| invalid(format!("context's user {name:?} names no entry of users")))?
                    .user
            }
        };
        if cluster.insecure_skip_tls_verify {
            return Err(invalid(
                "insecure-skip-tls-verify is not supported: give certificate-authority or certificate-authority-data"
                    .to_owned(),
            ));
        }
        for (field, set) in [
            ("exec", user.exec.is_some()),
            ("auth-provider", user.auth_provider.is_some()),
            ("username", user.username.is_some()),
        ] {
            if set {
                return Err(invalid(format!(
                    "user.{field} is not supported: use token, tokenFile or client-certificate/client-key"
                )));
            }
        }

        let has_cert = user.client_certificate_data.is_some() || user.client_certificate.is_some();
        let has_key = user.client_key_data.is_some() || user.client_key.is_some();
        if has_cert != has_key {
            return Err(invalid(
                "a client certificate needs both client-certificate and client-key".to_owned(),
            ));
        }
        let roots = match (
            &cluster.certificate_authority_data,
            &cluster.certificate_authority,
        ) {
            (Some(data), _) => {
                Some(decode_base64(data).map_err(|e| invalid(format!("certificate-authority-data: {e}")))?)
            }
            (None, Some(file)) => Some(read(&resolve(file))?),
            (None, None) => None,
        };
        let roots = match roots {
            Some(pem) => roots_from_pem(&pem).map_err(|e| invalid(format!("certificate authority: {e}")))?,
            None => system_roots().map_err(invalid)?,
        };
        let cert = match (&user.client_certificate_data, &user.client_certificate) {
            (Some(data), _) => {
                Some(decode_base64(data).map_err(|e| invalid(format!("client-certificate-data: {e}")))?)
            }
            (None, Some(file)) => Some(read(&resolve(file))?),
            (None, None) => None,
        };
        let key = match (&user.client_key_data, &user.client_key) {
            (Some(data), _) => {
                Some(decode_base64(data).map_err(|e| invalid(format!("client-key-data: {e}")))?)
            }
            (None, Some(file)) => Some(read(&resolve(file))?),
            (None, None) => None,
        };
        let identity = cert.zip(key);
        let tls = tls_config(roots, identity).map_err(invalid)?;
        let credentials = match (user.token, user.token_file) {
            (Some(token), _) => Credentials::Token(token),
            (None, Some(file)) => Credentials::TokenFile(resolve(&file)),
            (None, None) => Credentials::None,
        };
        let (host, port, path_prefix) = parse_server(&cluster.server).map_err(invalid)?;
        Ok(KubeEndpoint {
            server: cluster.server.trim_end_matches('/').to_owned(),
            server_name: cluster.tls_server_name.clone().unwrap_or_else(|| host.clone()),
            host,
            port,
            path_prefix,
            tls: Arc::new(tls),
            credentials,
            rate_limit: None,
        })
    }

    /// The endpoint a pod reaches kube-apiserver at, with its ServiceAccount.
    pub fn in_cluster() -> Result<KubeEndpoint, KubeConfigError> {
        let (Ok(host), Ok(port)) = (
            std::env::var("KUBERNETES_SERVICE_HOST"),
            std::env::var("KUBERNETES_SERVICE_PORT"),
        ) else {
            return Err(KubeConfigError::NotInCluster);
        };
        let dir = Path::new(IN_CLUSTER_DIR);
        let ca = dir.join("ca.crt");
        let roots = roots_from_pem(&read(&ca)?).map_err(|problem| KubeConfigError::Invalid {
            path: ca.clone(),
            problem,
        })?;
        let tls =
            tls_config(roots, None).map_err(|problem| KubeConfigError::Invalid { path: ca, problem })?;
        let port = port.parse().map_err(|_| KubeConfigError::Invalid {
            path: "KUBERNETES_SERVICE_PORT".into(),
            problem: format!("{port:?} is not a port"),
        })?;
        let server = if host.contains(':') {
            format!("https://[{host}]:{port}")
        } else {
            format!("https://{host}:{port}")
        };
        Ok(KubeEndpoint {
            server,
            // kube-apiserver's certificate always names the service.
            server_name: "kubernetes.default.svc".to_owned(),
            host,
            port,
            path_prefix: String::new(),
            tls: Arc::new(tls),
            credentials: Credentials::TokenFile(dir.join("token")),
            rate_limit: None,
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, KubeConfigError> {
    std::fs::read(path).map_err(|source| KubeConfigError::Read {
        path: path.to_owned(),
        source,
    })
}

fn decode_base64(data: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| format!("not base64: {e}"))
}

fn roots_from_pem(pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| e.to_string())?;
        roots.add(cert).map_err(|e| e.to_string())?;
    }
    if roots.is_empty() {
        return Err("no PEM certificate found".to_owned());
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore, String> {
    konnectivity_plumbing::tls::system_roots().map_err(|e| format!("no certificate authority given, and {e}"))
}

fn tls_config(roots: RootCertStore, identity: Option<(Vec<u8>, Vec<u8>)>) -> Result<ClientConfig, String> {
    let identity = match identity {
        None => None,
        Some((cert, key)) => Some((
            CertificateDer::pem_slice_iter(&cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("client certificate: {e}"))?,
            PrivateKeyDer::from_pem_slice(&key).map_err(|e| format!("client key: {e}"))?,
        )),
    };
    // As client-go's transport: HTTP/2 where kube-apiserver offers it.
    konnectivity_plumbing::tls::client_config_from(roots, identity, &[b"h2", b"http/1.1"])
        .map_err(|e| format!("client certificate and key: {e}"))
}

/// Splits `https://host:port/prefix` into its parts; the port defaults to 443.
fn parse_server(server: &str) -> Result<(String, u16, String), String> {
    let rest = server
        .strip_prefix("https://")
        .ok_or_else(|| format!("cluster server {server:?} must be an https:// URL"))?;
    let (authority, path) = match rest.find('/') {
        Some(at) => (&rest[..at], rest[at..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| format!("cluster server {server:?}: unclosed '['"))?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        None => 443,
        Some(port) => port
            .parse()
            .map_err(|_| format!("cluster server {server:?}: {port:?} is not a port"))?,
    };
    if host.is_empty() {
        return Err(format!("cluster server {server:?} names no host"));
    }
    Ok((host.to_owned(), port, path.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls_split_into_host_port_and_prefix() {
        assert_eq!(
            parse_server("https://10.0.0.1:6443").unwrap(),
            ("10.0.0.1".to_owned(), 6443, String::new())
        );
        assert_eq!(
            parse_server("https://[::1]:6443/k8s/").unwrap(),
            ("::1".to_owned(), 6443, "/k8s".to_owned())
        );
        assert_eq!(
            parse_server("https://kas.example").unwrap(),
            ("kas.example".to_owned(), 443, String::new())
        );
        assert!(
            parse_server("http://10.0.0.1:8080")
                .unwrap_err()
                .contains("https://")
        );
        assert!(parse_server("https://h:port").unwrap_err().contains("not a port"));
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kubeconfig-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec![]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn a_kubeconfig_with_a_token_file_and_a_ca_file_resolves_both_next_to_it() {
        let dir = scratch("files");
        write(&dir, "ca.crt", &ca_pem());
        let path = write(
            &dir,
            "kubeconfig",
            "apiVersion: v1\nkind: Config\ncurrent-context: main\n\
             clusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n    certificate-authority: ca.crt\n\
             users:\n- name: u\n  user:\n    tokenFile: token\n\
             contexts:\n- name: other\n  context: {cluster: missing, user: u}\n- name: main\n  context: {cluster: c, user: u}\n",
        );
        let endpoint = KubeEndpoint::from_kubeconfig(&path).unwrap();
        assert_eq!((endpoint.host.as_str(), endpoint.port), ("127.0.0.1", 6443));
        assert_eq!(endpoint.server_name, "127.0.0.1");
        assert!(
            matches!(endpoint.credentials, Credentials::TokenFile(ref file) if *file == dir.join("token"))
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn unsupported_or_broken_kubeconfigs_are_refused_naming_the_field() {
        let dir = scratch("bad");
        let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem());
        let cluster = format!(
            "clusters:\n- name: c\n  cluster:\n    server: https://h:6443\n    certificate-authority-data: {ca}\n"
        );
        for (user, expected) in [
            ("user:\n    exec: {command: aws}", "user.exec is not supported"),
            (
                "user:\n    client-certificate: c.crt",
                "needs both client-certificate and client-key",
            ),
        ] {
            let path = write(
                &dir,
                "kubeconfig",
                &format!(
                    "{cluster}users:\n- name: u\n  {user}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\n"
                ),
            );
            let error = KubeEndpoint::from_kubeconfig(&path).unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
        let path = write(
            &dir,
            "kubeconfig",
            &format!("{cluster}current-context: nope\ncontexts:\n- name: x\n  context: {{cluster: c}}\n"),
        );
        let error = KubeEndpoint::from_kubeconfig(&path).unwrap_err().to_string();
        assert!(error.contains("current-context \"nope\""), "{error}");
        let path = write(&dir, "kubeconfig", "clusters: [");
        assert!(KubeEndpoint::from_kubeconfig(&path).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
