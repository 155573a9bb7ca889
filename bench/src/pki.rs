//! The cluster scale run's certificates, made at run time (rcgen): the
//! cluster CA (the server's certificate, the egress agents' and the
//! control-plane agents' client certificates) and the node CA with one
//! client certificate per node, named as kubelet names its node
//! (`system:node:NAME`), so that the server tells every node apart.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

/// A certificate and its key on disk.
#[derive(Clone, Debug)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Where the run's certificates are.
#[derive(Clone, Debug)]
pub struct ClusterPki {
    pub dir: PathBuf,
}

impl ClusterPki {
    pub fn cluster_ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    pub fn node_ca(&self) -> PathBuf {
        self.dir.join("node-ca.crt")
    }
    pub fn server(&self) -> Pair {
        self.pair("server")
    }
    pub fn agent(&self) -> Pair {
        self.pair("agent")
    }
    pub fn control_plane_agent(&self, n: usize) -> Pair {
        self.pair(&format!("cp-{n}"))
    }
    pub fn node(&self, n: usize) -> Pair {
        self.pair(&format!("nodes/node-{n}"))
    }
    fn pair(&self, name: &str) -> Pair {
        Pair {
            cert: self.dir.join(format!("{name}.crt")),
            key: self.dir.join(format!("{name}.key")),
        }
    }

    /// Makes every certificate the run needs in `dir`; the servers' one
    /// names `server_hosts` too (servers behind one name share theirs).
    pub fn make(
        dir: &Path,
        control_plane_agents: usize,
        nodes: usize,
        server_hosts: &[String],
    ) -> anyhow::Result<ClusterPki> {
        std::fs::create_dir_all(dir.join("nodes"))?;
        let pki = ClusterPki { dir: dir.to_owned() };
        let cluster = authority("bench-cluster-ca")?;
        std::fs::write(pki.cluster_ca(), cluster.pem())?;
        let node_authority = authority("bench-node-client-ca")?;
        std::fs::write(pki.node_ca(), node_authority.pem())?;
        let mut names = vec!["localhost", "127.0.0.1"];
        names.extend(server_hosts.iter().map(String::as_str));
        leaf(
            &pki.server(),
            "proxy-server",
            &names,
            ExtendedKeyUsagePurpose::ServerAuth,
            &cluster,
        )?;
        leaf(
            &pki.agent(),
            "proxy-agent",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
            &cluster,
        )?;
        for n in 0..control_plane_agents {
            // The agent id as a name: what proves a control-plane id.
            let id = format!("cp-{n}");
            leaf(
                &pki.control_plane_agent(n),
                &id,
                &[&id],
                ExtendedKeyUsagePurpose::ClientAuth,
                &cluster,
            )?;
        }
        for n in 0..nodes {
            leaf(
                &pki.node(n),
                &format!("system:node:node-{n}"),
                &[],
                ExtendedKeyUsagePurpose::ClientAuth,
                &node_authority,
            )?;
        }
        Ok(pki)
    }
}

fn authority(name: &str) -> anyhow::Result<CertifiedIssuer<'static, KeyPair>> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    Ok(CertifiedIssuer::self_signed(params, KeyPair::generate()?)?)
}

fn leaf(
    files: &Pair,
    name: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
    issuer: &CertifiedIssuer<'static, KeyPair>,
) -> anyhow::Result<()> {
    let sans: Vec<String> = sans.iter().map(|san| (*san).to_owned()).collect();
    let mut params = CertificateParams::new(sans)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    std::fs::write(&files.cert, cert.pem()).with_context(|| format!("writing {}", files.cert.display()))?;
    std::fs::write(&files.key, key.serialize_pem())
        .with_context(|| format!("writing {}", files.key.display()))?;
    Ok(())
}
