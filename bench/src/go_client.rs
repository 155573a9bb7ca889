//! The second, independent client: `bench/go/connect-client.go`, built by
//! `hack/bench.sh` with Go's standard library only. It talks to the CONNECT
//! frontend the way Go programs do (kube-apiserver among them), so the
//! round-trip and dial figures do not rest on our own client alone. Built
//! again with `bench/go/grpc_tunnel.go` and Debian's grpc-go, it dials the
//! gRPC frontend as kube-apiserver does (a ClientConn per tunnel).

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, bail};
use serde_json::Value;

/// One measurement of the Go client, on the direct route (`via` is `None`)
/// or through a frontend's Unix socket: `-proxy-uds` (CONNECT) or
/// `-grpc-uds` (gRPC, the client built with `-tags grpc`).
pub struct GoRun<'a> {
    pub client: &'a Path,
    pub via: Option<(&'static str, &'a Path)>,
    pub target: SocketAddr,
}

impl GoRun<'_> {
    /// Runs `mode` with `extra` flags and returns the figure named `field`
    /// from the JSON line it prints.
    pub async fn figure(&self, mode: &str, extra: &[String], field: &str) -> anyhow::Result<f64> {
        Ok(self.figures(mode, extra, &[field]).await?[0])
    }

    /// As [`GoRun::figure`], for several figures of one run.
    pub async fn figures(&self, mode: &str, extra: &[String], fields: &[&str]) -> anyhow::Result<Vec<f64>> {
        let mut command = tokio::process::Command::new(self.client);
        command
            .arg(format!("-mode={mode}"))
            .arg(format!("-target={}", self.target))
            .args(extra);
        if let Some((flag, uds)) = self.via {
            command.arg(format!("-{flag}={}", uds.display()));
        }
        let output = command
            .output()
            .await
            .with_context(|| format!("running {}", self.client.display()))?;
        if !output.status.success() {
            bail!(
                "{} -mode={mode} failed ({}): {}",
                self.client.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let line = String::from_utf8_lossy(&output.stdout);
        let value: Value = serde_json::from_str(line.trim())
            .with_context(|| format!("the Go client printed {line:?}, not one JSON object"))?;
        fields
            .iter()
            .map(|field| {
                value[field]
                    .as_f64()
                    .with_context(|| format!("the Go client's {mode} line {line:?} has no {field}"))
            })
            .collect()
    }
}
