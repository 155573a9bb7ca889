//! The cluster run's kube-apiserver for Leases (`cluster --leases`): the
//! stand-in the integration tests hold upstream's Lease protocol to
//! (resourceVersions, 409 conflicts, label selectors, watches from a
//! version, 410 Expired), so that the servers' Lease controllers and 5,000
//! agents' counters meet the same API they meet in the tests. It is served
//! from this process on a runtime of its own: its watches do not wait on
//! the run's measurements, nor the measurements on it. It counts every
//! call, and the run says what each phase cost kube-apiserver.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use konnectivity_kube_standin::{KubeApi, ServingCert};
use konnectivity_plumbing::tls::{Identity, PemFile};

use crate::pki::ClusterPki;

/// The flags that make an agent count the servers by their Leases, as
/// upstream's HA manifests set them (namespace and selector: the defaults,
/// which are the servers' defaults too).
pub fn agent_flags(kubeconfig: &Path) -> [String; 2] {
    [
        "--count-server-leases".to_owned(),
        format!("--kubeconfig={}", kubeconfig.display()),
    ]
}

/// The flags that make a server publish its Lease and collect expired ones.
pub fn server_flags(kubeconfig: &Path) -> [String; 2] {
    [
        "--enable-lease-controller".to_owned(),
        format!("--kubeconfig={}", kubeconfig.display()),
    ]
}

/// The stand-in, serving until dropped.
pub struct LeaseApi {
    api: Option<KubeApi>,
    /// For the servers and the agents: the stand-in's address, its CA, a token.
    pub kubeconfig: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl LeaseApi {
    /// Serves with the servers' certificate (valid for 127.0.0.1) on a
    /// port of the kernel's choosing; the kubeconfig is written to `dir`.
    pub async fn start(pki: &ClusterPki, dir: &Path) -> anyhow::Result<LeaseApi> {
        let pair = pki.server();
        let identity = Identity {
            cert: PemFile::new("cluster-cert", pair.cert),
            key: PemFile::new("cluster-key", pair.key),
        };
        // ALPN is the stand-in's to set (h2 and http/1.1, as kube-apiserver).
        let tls = konnectivity_plumbing::tls::server_config(&identity, None, &[], &Default::default())?;
        let cert = ServingCert {
            tls: Arc::new(tls),
            ca: pki.cluster_ca(),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lease-standin")
            .enable_all()
            .build()?;
        // Started on its runtime, so that what it spawns runs there.
        let api = runtime
            .spawn(KubeApi::start(cert))
            .await?
            .context("the stand-in kube-apiserver for Leases")?;
        let kubeconfig = api.kubeconfig(dir);
        Ok(LeaseApi {
            api: Some(api),
            kubeconfig,
            runtime: Some(runtime),
        })
    }

    /// Every call so far, by kind ("GET watch", "PUT update", ...).
    pub fn calls(&self) -> BTreeMap<String, usize> {
        self.api.as_ref().map(KubeApi::all_calls).unwrap_or_default()
    }

    /// The Leases stored now, by name.
    pub fn lease_names(&self) -> Vec<String> {
        self.api
            .as_ref()
            .map(|api| api.lease_names("kube-system"))
            .unwrap_or_default()
    }
}

impl Drop for LeaseApi {
    fn drop(&mut self) {
        // The stand-in first (it stops its tasks), then its runtime, without
        // waiting: this is dropped inside the run's own runtime, where a
        // blocking shutdown is not allowed.
        drop(self.api.take());
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The calls made between two readings of [`LeaseApi::calls`], as one
/// table cell: "GET list 5004, GET watch 5004, PUT update 12".
pub fn calls_between(before: &BTreeMap<String, usize>, after: &BTreeMap<String, usize>) -> String {
    let made: Vec<String> = after
        .iter()
        .filter_map(|(call, count)| {
            let made = count - before.get(call).copied().unwrap_or(0);
            (made > 0).then(|| format!("{call} {made}"))
        })
        .collect();
    if made.is_empty() {
        "none".to_owned()
    } else {
        made.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phases_calls_are_those_made_in_it_only() {
        let before = BTreeMap::from([("GET list".to_owned(), 3), ("GET watch".to_owned(), 3)]);
        let after = BTreeMap::from([
            ("GET list".to_owned(), 3),
            ("GET watch".to_owned(), 10),
            ("PUT update".to_owned(), 2),
        ]);
        assert_eq!(calls_between(&before, &after), "GET watch 7, PUT update 2");
        assert_eq!(calls_between(&after, &after), "none");
    }
}
