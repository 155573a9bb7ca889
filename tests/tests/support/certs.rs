//! A throwaway PKI made with rcgen at test time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    SigningKey,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// One certificate and key on disk.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Files for every identity a test needs.
pub struct Pki {
    pub ca: PathBuf,
    /// proxy-server (and the stand-in kube-apiserver): SANs localhost,
    /// 127.0.0.1, 10.222.0.2, kubernetes.default.svc.
    pub server: CertFiles,
    /// proxy-agent client certificate.
    pub agent: CertFiles,
    /// Frontend client (what kube-apiserver presents).
    pub client: CertFiles,
    /// A client certificate from a CA the server does not trust.
    pub stranger: CertFiles,
    /// The CA of node agents' client certificates (the node frontend's).
    pub node_ca: PathBuf,
    /// A node agent's client certificate, from `node_ca`.
    pub node_client: CertFiles,
    /// Another node's (`node-2`), from `node_ca`.
    pub other_node_client: CertFiles,
    /// A control-plane agent's certificate: CN and DNS SAN `cp-1`.
    pub control_plane_agent: CertFiles,
    /// The kube-apiserver stand-in: SANs the service VIPs 10.96.0.1 and
    /// fd00:96::1, the private endpoint 10.222.1.10 and kubernetes.default.
    pub kas: CertFiles,
    /// A client certificate from the trusted CA in X.509 v1 form (no
    /// extensions), as `openssl x509 -req` without `-extfile` makes them:
    /// Go accepts it, rustls does not.
    pub v1_client: CertFiles,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn leaf(
    dir: &Path,
    name: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
    issuer: &CertifiedIssuer<'static, KeyPair>,
) -> CertFiles {
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(sans).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    // A common name such as system:node:node-1 makes a file node-1.
    let file = name.rsplit(':').next().unwrap_or(name);
    let files = CertFiles {
        cert: dir.join(format!("{file}.crt")),
        key: dir.join(format!("{file}.key")),
    };
    std::fs::write(&files.cert, cert.pem()).unwrap();
    std::fs::write(&files.key, key.serialize_pem()).unwrap();
    files
}

/// A leaf certificate in X.509 v1 form, signed by `issuer`: rcgen writes
/// only v3, so its TBSCertificate is taken apart, the `[0] version` and
/// `[3] extensions` fields are left out (which makes it v1, the DEFAULT
/// version) and the result is signed again.
fn v1_leaf(dir: &Path, name: &str, issuer: &CertifiedIssuer<'static, KeyPair>) -> CertFiles {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    let v3 = params.signed_by(&key, issuer).unwrap();
    let [tbs, algorithm, _signature] = der::elements(der::content(v3.der())).try_into().unwrap();
    let fields: Vec<&[u8]> = der::elements(der::content(tbs))
        .into_iter()
        .filter(|field| field[0] != 0xa0 && field[0] != 0xa3)
        .collect();
    let tbs = der::encode(0x30, &fields.concat());
    let signature = [&[0u8][..], &issuer.key().sign(&tbs).unwrap()].concat();
    let cert = der::encode(
        0x30,
        &[&tbs[..], algorithm, &der::encode(0x03, &signature)].concat(),
    );
    // A common name such as system:node:node-1 makes a file node-1.
    let file = name.rsplit(':').next().unwrap_or(name);
    let files = CertFiles {
        cert: dir.join(format!("{file}.crt")),
        key: dir.join(format!("{file}.key")),
    };
    std::fs::write(&files.cert, pem_certificate(&cert)).unwrap();
    std::fs::write(&files.key, key.serialize_pem()).unwrap();
    files
}

/// PEM text of a DER certificate.
fn pem_certificate(der: &[u8]) -> String {
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = body
        .as_bytes()
        .chunks(64)
        .map(|l| std::str::from_utf8(l).unwrap())
        .collect();
    format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        lines.join("\n")
    )
}

/// Just enough DER for [`v1_leaf`]: definite lengths, one-byte tags.
mod der {
    /// The header length and content length of the element at the start of `bytes`.
    fn header(bytes: &[u8]) -> (usize, usize) {
        match bytes[1] {
            short @ 0..=0x7f => (2, usize::from(short)),
            long => {
                let count = usize::from(long & 0x7f);
                let length = bytes[2..2 + count]
                    .iter()
                    .fold(0, |n, &b| n << 8 | usize::from(b));
                (2 + count, length)
            }
        }
    }

    /// The content of one element.
    pub fn content(element: &[u8]) -> &[u8] {
        let (header, length) = header(element);
        &element[header..header + length]
    }

    /// The whole elements (header and content) one after another in `bytes`.
    pub fn elements(mut bytes: &[u8]) -> Vec<&[u8]> {
        let mut elements = Vec::new();
        while !bytes.is_empty() {
            let (header, length) = header(bytes);
            let (element, rest) = bytes.split_at(header + length);
            elements.push(element);
            bytes = rest;
        }
        elements
    }

    /// An element with `tag` around `content`.
    pub fn encode(tag: u8, content: &[u8]) -> Vec<u8> {
        let mut element = vec![tag];
        match content.len() {
            short @ 0..=0x7f => element.push(short as u8),
            long => {
                let bytes = long.to_be_bytes();
                let significant = &bytes[bytes.iter().position(|&b| b != 0).unwrap()..];
                element.push(0x80 | significant.len() as u8);
                element.extend_from_slice(significant);
            }
        }
        element.extend_from_slice(content);
        element
    }
}

impl Pki {
    pub fn new(dir: &Path) -> Pki {
        let authority = ca("konnectivity-test-ca");
        let other = ca("untrusted-ca");
        let ca_path = dir.join("ca.crt");
        std::fs::write(&ca_path, authority.pem()).unwrap();
        let node_authority = ca("konnectivity-node-client-ca");
        let node_ca = dir.join("node-ca.crt");
        std::fs::write(&node_ca, node_authority.pem()).unwrap();
        Pki {
            ca: ca_path,
            server: leaf(
                dir,
                "proxy-server",
                // 10.222.0.2: the server's address in the network-namespace
                // tests; 10.222.1.21 and .22: each server's own when several
                // are listed without a balancer (support::kas::server_ip).
                // kubernetes.default.svc: the name pods check
                // kube-apiserver's certificate against (the stand-in
                // kube-apiserver serves this certificate).
                &[
                    "localhost",
                    "127.0.0.1",
                    "10.222.0.2",
                    "10.222.1.21",
                    "10.222.1.22",
                    "kubernetes.default.svc",
                ],
                ExtendedKeyUsagePurpose::ServerAuth,
                &authority,
            ),
            agent: leaf(
                dir,
                "proxy-agent",
                &[],
                ExtendedKeyUsagePurpose::ClientAuth,
                &authority,
            ),
            client: leaf(
                dir,
                "kube-apiserver",
                &[],
                ExtendedKeyUsagePurpose::ClientAuth,
                &authority,
            ),
            stranger: leaf(dir, "stranger", &[], ExtendedKeyUsagePurpose::ClientAuth, &other),
            // Named as kubelet's client certificates name their node.
            node_client: leaf(
                dir,
                "system:node:node-1",
                &[],
                ExtendedKeyUsagePurpose::ClientAuth,
                &node_authority,
            ),
            other_node_client: leaf(
                dir,
                "system:node:node-2",
                &[],
                ExtendedKeyUsagePurpose::ClientAuth,
                &node_authority,
            ),
            // Its agent id as a name, on the node cp-node.
            control_plane_agent: leaf(
                dir,
                "system:node:cp-node",
                &["cp-1"],
                ExtendedKeyUsagePurpose::ClientAuth,
                &authority,
            ),
            kas: leaf(
                dir,
                "kube-apiserver-standin",
                &["10.96.0.1", "fd00:96::1", "10.222.1.10", "kubernetes.default"],
                ExtendedKeyUsagePurpose::ServerAuth,
                &authority,
            ),
            v1_client: v1_leaf(dir, "v1-client", &authority),
            node_ca,
        }
    }

    /// What the stand-in kube-apiserver serves with: the server certificate.
    pub fn kube_api_cert(&self) -> super::kube_api::ServingCert {
        super::kube_api::ServingCert {
            tls: self.server_tls(&self.server),
            ca: self.ca.clone(),
        }
    }

    /// A rustls server config presenting `identity` (no client certificates).
    pub fn server_tls(&self, identity: &CertFiles) -> Arc<rustls::ServerConfig> {
        let config =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    CertificateDer::pem_file_iter(&identity.cert)
                        .unwrap()
                        .map(Result::unwrap)
                        .collect(),
                    PrivateKeyDer::from_pem_file(&identity.key).unwrap(),
                )
                .unwrap();
        Arc::new(config)
    }

    /// A rustls client config trusting the test CA, presenting `identity`.
    pub fn client_tls(&self, identity: Option<&CertFiles>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let builder =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots);
        let mut config = match identity {
            Some(files) => builder
                .with_client_auth_cert(
                    CertificateDer::pem_file_iter(&files.cert)
                        .unwrap()
                        .map(Result::unwrap)
                        .collect(),
                    PrivateKeyDer::from_pem_file(&files.key).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}
