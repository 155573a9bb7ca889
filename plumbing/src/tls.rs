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

/// The certificate chain and private key of an identity.
fn load_identity(
    identity: &Identity,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    Ok((
        load_certificates(&identity.cert)?,
        load_private_key(&identity.key)?,
    ))
}

/// Server-side TLS. With `client_ca`, every client must present a certificate
/// signed by it (mTLS); without, no client certificate is asked for.
pub fn server_config(
    identity: &Identity,
    client_ca: Option<&PemFile>,
    alpn: &[&[u8]],
    tls13_only: bool,
) -> Result<ServerConfig, TlsError> {
    let versions: &[&rustls::SupportedProtocolVersion] = if tls13_only {
        &[&rustls::version::TLS13]
    } else {
        rustls::DEFAULT_VERSIONS
    };
    let builder = ServerConfig::builder_with_provider(provider())
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
pub fn accept_tls(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    what: &'static str,
) -> mpsc::Receiver<TlsStream<TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
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
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(stream).await;
                    }
                    Ok(Err(error)) => {
                        tracing::info!(%peer, %error, listener = what, "TLS handshake failed")
                    }
                    Err(_) => tracing::info!(%peer, listener = what, "TLS handshake timed out"),
                }
            });
        }
    });
    rx
}

/// The server name to verify a peer against: an IP address or a DNS name.
pub fn server_name(host: &str) -> Result<rustls_pki_types::ServerName<'static>, io::Error> {
    rustls_pki_types::ServerName::try_from(host.trim_matches(|c| c == '[' || c == ']').to_owned())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name {host:?}: {e}")))
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
