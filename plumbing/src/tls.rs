//! TLS configuration from PEM files, with ring as the one crypto provider.
//!
//! Every error names the flag whose file was at fault, so an operator knows
//! which line of the manifest to fix.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// A file given on the command line, remembered with its flag for errors.
#[derive(Clone, Debug)]
pub struct PemFile {
    pub flag: &'static str,
    pub path: PathBuf,
}

impl PemFile {
    pub fn new(flag: &'static str, path: impl Into<PathBuf>) -> Self {
        PemFile {
            flag,
            path: path.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--{flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: rustls_pki_types::pem::Error,
    },
    #[error("--{flag} {path}: no PEM certificate found")]
    NoCertificate { flag: &'static str, path: PathBuf },
    #[error("--{flag} {path}: certificate rejected: {source}")]
    BadCertificate {
        flag: &'static str,
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("--{flag} {path}: {source}")]
    Verifier {
        flag: &'static str,
        path: PathBuf,
        source: rustls::server::VerifierBuilderError,
    },
    #[error("certificate --{cert_flag} and key --{key_flag} do not form a usable pair: {source}")]
    KeyPair {
        cert_flag: &'static str,
        key_flag: &'static str,
        source: rustls::Error,
    },
    #[error("--{flag} {path}: {problem}")]
    Unsupported {
        flag: &'static str,
        path: PathBuf,
        problem: String,
    },
    #[error("loading the system's trusted certificates: {0}")]
    SystemRoots(String),
}

/// The one crypto provider of the project.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub fn load_certificates(file: &PemFile) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read_error = |source| TlsError::Read {
        flag: file.flag,
        path: file.path.clone(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(&file.path)
        .map_err(read_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read_error)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            flag: file.flag,
            path: file.path.clone(),
        });
    }
    Ok(certs)
}

pub fn load_private_key(file: &PemFile) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(&file.path).map_err(|source| TlsError::Read {
        flag: file.flag,
        path: file.path.clone(),
        source,
    })
}

pub fn load_roots(file: &PemFile) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certificates(file)? {
        roots.add(cert).map_err(|source| TlsError::BadCertificate {
            flag: file.flag,
            path: file.path.clone(),
            source,
        })?;
    }
    Ok(roots)
}

/// A certificate and its key, as given by a pair of flags.
#[derive(Clone, Debug)]
pub struct Identity {
    pub cert: PemFile,
    pub key: PemFile,
}

impl Identity {
    /// The error for a certificate and key that rustls will not pair.
    fn pair_error(&self, source: rustls::Error) -> TlsError {
        TlsError::KeyPair {
            cert_flag: self.cert.flag,
            key_flag: self.key.flag,
            source,
        }
    }
}

/// The certificate chain and private key of an identity, refusing at once,
/// with the fix, a chain rustls could not use although Go would.
fn load_identity(
    identity: &Identity,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let certs = load_certificates(&identity.cert)?;
    for cert in &certs {
        if let Some(problem) = unsupported_shape(cert) {
            return Err(TlsError::Unsupported {
                flag: identity.cert.flag,
                path: identity.cert.path.clone(),
                problem,
            });
        }
    }
    Ok((certs, load_private_key(&identity.key)?))
}

/// How to re-issue a certificate as X.509 v3, for messages.
const REISSUE_V3: &str = "re-issue it as X.509 v3 with extensions \
     (e.g. openssl x509 -req … -extfile FILE, FILE holding basicConstraints and extendedKeyUsage lines)";

/// What about a certificate Go's crypto/x509 accepts and rustls (webpki,
/// ring) refuses: an X.509 v1 certificate (no extensions), an RSA key under
/// 2048 bits, an ECDSA key on P-521. (A v1 CA certificate is fine as a
/// trust anchor: webpki takes anchors of any version.)
pub fn unsupported_shape(der: &[u8]) -> Option<String> {
    use x509_parser::public_key::PublicKey;
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject().to_string();
    if cert.version() != x509_parser::x509::X509Version::V3 {
        return Some(format!(
            "certificate {subject:?} is X.509 v{}, which rustls refuses (Go accepts it): {REISSUE_V3}",
            cert.version().0 + 1
        ));
    }
    match cert.public_key().parsed() {
        Ok(PublicKey::RSA(rsa)) if rsa.key_size() < 2048 => Some(format!(
            "certificate {subject:?} has a {}-bit RSA key; rustls needs at least 2048 bits (Go accepts less): \
             re-issue it with a larger key",
            rsa.key_size()
        )),
        Ok(PublicKey::EC(_))
            if cert
                .public_key()
                .algorithm
                .parameters
                .as_ref()
                .and_then(|curve| curve.as_oid().ok())
                .is_some_and(|curve| curve.to_id_string() == "1.3.132.0.35") =>
        {
            Some(format!(
                "certificate {subject:?} has an ECDSA P-521 key, which rustls does not support (P-256 and P-384 it does): \
                 re-issue it with one of those"
            ))
        }
        _ => None,
    }
}

/// The rustls error inside `error` (directly, or in an I/O error), if any.
fn rustls_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut source = Some(error);
    while let Some(error) = source {
        let found = error.downcast_ref::<rustls::Error>().or_else(|| {
            error
                .downcast_ref::<io::Error>()?
                .get_ref()?
                .downcast_ref::<rustls::Error>()
        });
        if found.is_some() {
            return found;
        }
        source = error.source();
    }
    None
}

/// What an operator should know about a handshake a listener refused, when
/// the cause is one a log line can name: the peer's certificate, or a
/// client that refused ours.
pub fn explain_handshake_failure(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    use rustls::{CertificateError, Error as Rustls};
    match rustls_error(error)? {
        Rustls::InvalidCertificate(CertificateError::Other(other))
            if other.0.downcast_ref::<webpki::Error>() == Some(&webpki::Error::UnsupportedCertVersion) =>
        {
            Some(format!(
                "the peer's certificate is X.509 v1, which rustls refuses (Go accepts it): {REISSUE_V3}"
            ))
        }
        Rustls::InvalidCertificate(CertificateError::UnknownIssuer) => Some(
            "the peer's client certificate is not signed by the CA this listener trusts (its --*-ca-cert flag)"
                .to_owned(),
        ),
        Rustls::InvalidCertificate(problem) => Some(format!("the peer's certificate was refused: {problem:?}")),
        Rustls::NoCertificatesPresented => Some(
            "the peer sent no client certificate: it needs one signed by the CA this listener trusts \
             (Go clients also send none when their key is of a type this side does not offer: \
             ECDSA P-521, RSA under 2048 bits)"
                .to_owned(),
        ),
        Rustls::AlertReceived(alert) => Some(format!(
            "the peer ended the handshake ({alert:?}): it does not trust this listener's certificate \
             (the CA it was given is not the one that signed it, or the name it dialed is not in it)"
        )),
        Rustls::PeerIncompatible(problem) => Some(format!("the peer's TLS is incompatible: {problem:?}")),
        Rustls::NoApplicationProtocol => Some(
            "the peer offered no application protocol (ALPN) this listener serves: the frontend serves \
             http/1.1 with --mode=http-connect and h2 with --mode=grpc, the agent and node listeners h2; \
             a gRPC client on an HTTP CONNECT frontend (or the reverse) ends here: match --mode to the client"
                .to_owned(),
        ),
        _ => None,
    }
}

/// The flags a TLS client was configured by, to name in its errors.
#[derive(Clone, Copy, Debug)]
pub struct ClientFlags {
    /// The CA the server's certificate must chain to (`--ca-cert`).
    pub ca: &'static str,
    /// The client certificate and key (`--agent-cert`, `--agent-key`).
    pub cert: &'static str,
    pub key: &'static str,
    /// The name the client dials, which the certificate must carry.
    pub host: &'static str,
}

/// What to fix when a client's handshake with `host` failed, naming the
/// flag or file at fault; `None` when the error is not one of TLS's.
pub fn explain_client_failure(
    error: &(dyn std::error::Error + 'static),
    host: &str,
    flags: ClientFlags,
) -> Option<String> {
    use rustls::{AlertDescription, CertificateError, Error as Rustls};
    let ClientFlags {
        ca,
        cert,
        key,
        host: host_flag,
    } = flags;
    // An alert that arrives after the client's side of a TLS 1.3 handshake
    // (the server refusing the client's certificate) surfaces on the first
    // read, as an I/O error that kept only the text of rustls' error.
    let text = crate::error_chain(error);
    let alert = |name: &str| text.contains(&format!("received fatal alert: {name}"));
    if alert("CertificateRequired") {
        return Some(format!(
            "the server requires a client certificate: set --{cert} and --{key} (one signed by the CA the \
             server trusts for this listener)"
        ));
    }
    if alert("BadCertificate") || alert("UnknownCA") || alert("CertificateUnknown") {
        return Some(format!(
            "the server refused the client certificate in --{cert}: it is not signed by the CA the server \
             trusts for this listener"
        ));
    }
    Some(match rustls_error(error)? {
        Rustls::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "the server's certificate does not name {host:?} (as a DNS or IP subject alternative name): \
             reissue it with that name, or give --{host_flag} a name it carries"
        ),
        Rustls::InvalidCertificate(CertificateError::UnknownIssuer) => format!(
            "the server's certificate is not signed by the CA in --{ca} (without --{ca}, the system's roots \
             are used): give --{ca} the CA that signed it"
        ),
        Rustls::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            "the server's certificate has expired: reissue it".to_owned()
        }
        Rustls::AlertReceived(AlertDescription::CertificateRequired) => format!(
            "the server requires a client certificate: set --{cert} and --{key} (one signed by the CA the \
             server trusts for this listener)"
        ),
        Rustls::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown,
        ) => format!(
            "the server refused the client certificate in --{cert}: it is not signed by the CA the server \
             trusts for this listener"
        ),
        other => return explain_handshake_failure(error).or_else(|| Some(format!("TLS: {other}"))),
    })
}

/// Peers already warned about, so a peer retrying every second is named
/// once, not every time; forgotten wholesale past a bound.
#[derive(Default)]
struct WarnedPeers(std::sync::Mutex<std::collections::HashSet<std::net::IpAddr>>);

impl WarnedPeers {
    const BOUND: usize = 4096;

    fn first_time(&self, peer: std::net::IpAddr) -> bool {
        let mut warned = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if warned.len() >= Self::BOUND {
            warned.clear();
        }
        warned.insert(peer)
    }
}

/// Server-side TLS. With `client_ca`, every client must present a certificate
/// signed by it (mTLS); without, no client certificate is asked for.
/// What a TLS listener offers: `--tls-min-version` and `--cipher-suites`.
#[derive(Clone, Debug, Default)]
pub struct TlsOffer {
    /// TLS 1.3 alone (`--tls-min-version=VersionTLS13`).
    pub tls13_only: bool,
    /// The TLS 1.2 suites offered; empty: every one this build has. TLS
    /// 1.3's suites are always offered, as Go offers them whatever its
    /// `CipherSuites` say.
    pub tls12_suites: Vec<rustls::SupportedCipherSuite>,
}

/// The cipher suites this build has, by the names Go's crypto/tls (and so
/// upstream's `--cipher-suites`) gives them. Go also has CBC and RSA
/// key-exchange suites and 3DES; rustls has none of them, on purpose.
pub const GO_CIPHER_SUITES: &[(&str, rustls::SupportedCipherSuite)] = {
    use rustls::crypto::ring::cipher_suite::*;
    &[
        ("TLS_AES_128_GCM_SHA256", TLS13_AES_128_GCM_SHA256),
        ("TLS_AES_256_GCM_SHA384", TLS13_AES_256_GCM_SHA384),
        ("TLS_CHACHA20_POLY1305_SHA256", TLS13_CHACHA20_POLY1305_SHA256),
        (
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
            TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305",
            TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
            TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        ),
        (
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305",
            TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
    ]
};

/// The suites named in Go's names, or what is wrong: a name this build
/// does not have, listed beside every name it has.
pub fn cipher_suites_by_go_name(names: &[String]) -> Result<Vec<rustls::SupportedCipherSuite>, String> {
    let mut suites = Vec::new();
    for name in names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        let Some((_, suite)) = GO_CIPHER_SUITES.iter().find(|(go, _)| *go == name) else {
            let known: Vec<&str> = GO_CIPHER_SUITES.iter().map(|(go, _)| *go).collect();
            return Err(format!(
                "{name} is not available (no CBC, RSA key exchange or 3DES suites); available: {}",
                known.join(", ")
            ));
        };
        if !suites.contains(suite) {
            suites.push(*suite);
        }
    }
    Ok(suites)
}

pub fn server_config(
    identity: &Identity,
    client_ca: Option<&PemFile>,
    alpn: &[&[u8]],
    offer: &TlsOffer,
) -> Result<ServerConfig, TlsError> {
    let versions: &[&rustls::SupportedProtocolVersion] = if offer.tls13_only {
        &[&rustls::version::TLS13]
    } else {
        rustls::DEFAULT_VERSIONS
    };
    let mut offered = rustls::crypto::ring::default_provider();
    if !offer.tls12_suites.is_empty() {
        offered
            .cipher_suites
            .retain(|suite| suite.version() == &rustls::version::TLS13 || offer.tls12_suites.contains(suite));
    }
    let builder = ServerConfig::builder_with_provider(Arc::new(offered))
        .with_protocol_versions(versions)
        .expect("ring supports TLS 1.2 and 1.3");
    let builder = match client_ca {
        Some(ca) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
                .build()
                .map_err(|source| TlsError::Verifier {
                    flag: ca.flag,
                    path: ca.path.clone(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let (certs, key) = load_identity(identity)?;
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|source| identity.pair_error(source))?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// Client-side TLS. Without `ca`, the system's trusted roots are used.
pub fn client_config(
    ca: Option<&PemFile>,
    identity: Option<&Identity>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, TlsError> {
    let roots = match ca {
        Some(ca) => load_roots(ca)?,
        None => system_roots()?,
    };
    match identity {
        Some(identity) => {
            let pair = load_identity(identity)?;
            client_config_from(roots, Some(pair), alpn).map_err(|source| identity.pair_error(source))
        }
        None => {
            Ok(client_config_from(roots, None, alpn)
                .expect("without a client certificate nothing is refused"))
        }
    }
}

/// The system's trusted certificates.
pub fn system_roots() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    if roots.is_empty() {
        return Err(TlsError::SystemRoots(format!("none found: {:?}", found.errors)));
    }
    Ok(roots)
}

/// Client-side TLS from certificates already loaded; the error is rustls'
/// refusal of the certificate and key, the only thing that can fail here.
pub fn client_config_from(
    roots: RootCertStore,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, rustls::Error> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots);
    let mut config = match identity {
        Some((certs, key)) => builder.with_client_auth_cert(certs, key)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// How long a peer may take to finish the TLS handshake before we drop it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts TCP connections and completes their TLS handshakes concurrently,
/// so one slow or hostile peer cannot hold up the accept loop. Failed
/// handshakes are logged and dropped; only established streams come out.
/// With `stop`, the listening socket closes as soon as the drain is
/// signalled (the stream of connections then ends); without, it accepts
/// until the runtime stops.
pub fn accept_tls(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    what: &'static str,
    stop: Option<crate::lifecycle::Watcher>,
) -> mpsc::Receiver<TlsStream<TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    let warned = Arc::new(WarnedPeers::default());
    tokio::spawn(async move {
        let stopped = async {
            match &stop {
                Some(stop) => stop.signaled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(stopped);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = &mut stopped => return,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, listener = what, "accept failed");
                    // Typically EMFILE: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            if tx.is_closed() {
                return;
            }
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let warned = warned.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(stream).await;
                    }
                    Ok(Err(error)) => match explain_handshake_failure(&error) {
                        Some(problem) if warned.first_time(peer.ip()) => {
                            tracing::warn!(%peer, listener = what, %problem, "TLS handshake refused (logged once per peer address)")
                        }
                        Some(problem) => {
                            tracing::debug!(%peer, listener = what, %problem, "TLS handshake refused")
                        }
                        // Not one a log line can explain (a port scan, a
                        // client speaking plain text): named once per peer.
                        None if warned.first_time(peer.ip()) => {
                            tracing::warn!(%peer, %error, listener = what, "TLS handshake failed (logged once per peer address)")
                        }
                        None => tracing::debug!(%peer, %error, listener = what, "TLS handshake failed"),
                    },
                    Err(_) => tracing::info!(%peer, listener = what, "TLS handshake timed out"),
                }
            });
        }
    });
    rx
}

/// The names a certificate vouches for: its subject common names and DNS
/// subject alternative names. Used to bind an authenticated peer to the
/// identity it claims (e.g. a control-plane agent id).
pub fn certificate_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                names.push((*dns).to_owned());
            }
        }
    }
    names
}
