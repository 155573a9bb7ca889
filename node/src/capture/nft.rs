//! The host capture rules: one nftables table of our own, rendered from the
//! capture map by a pure function and applied as a single `nft -f -`
//! transaction, so it is atomic, idempotent, and removed by deleting one table.

use std::io::Write;
use std::net::SocketAddr;
use std::process::Stdio;

use crate::capture::map::CaptureMap;
use crate::programs::NFT;

pub(crate) const TABLE_FAMILY: &str = "inet";
pub(crate) const TABLE_NAME: &str = "konnectivity";
/// Before kube-proxy's DNAT (priority -100): we must see the VIP before it
/// is rewritten to an endpoint.
pub(crate) const PRIORITY: i32 = -110;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("running nft: {0} (is the nftables package installed?)")]
    Spawn(std::io::Error),
    #[error("nft refused the ruleset: {0}")]
    Refused(String),
}

/// The ruleset that redirects every captured VIP:PORT to `capture_port`,
/// except connections whose socket carries `mark` (the agent's own). The
/// leading `add`/`delete` pair replaces any stale table in the same
/// transaction, so there is never a moment without rules or with two sets.
pub(crate) fn render(map: &CaptureMap, capture_port: u16, mark: u32) -> String {
    let mut rules = String::new();
    for capture in map.entries() {
        let family = match capture.destination {
            SocketAddr::V4(_) => "ip",
            SocketAddr::V6(_) => "ip6",
        };
        rules.push_str(&format!(
            "    {family} daddr {} tcp dport {} redirect to :{capture_port}\n",
            capture.destination.ip(),
            capture.destination.port()
        ));
    }
    format!(
        "add table {TABLE_FAMILY} {TABLE_NAME}\n\
         delete table {TABLE_FAMILY} {TABLE_NAME}\n\
         table {TABLE_FAMILY} {TABLE_NAME} {{\n  \
         chain output {{\n    \
         type nat hook output priority {PRIORITY}; policy accept;\n    \
         meta mark {mark:#x} return\n\
         {rules}  \
         }}\n\
         }}\n"
    )
}

/// Applies a ruleset with `nft -f -` in the current network namespace.
pub(crate) fn apply(ruleset: &str) -> Result<(), NftError> {
    run_nft(&["-f", "-"], Some(ruleset))
}

/// Deletes our table; a table that is already gone is not an error.
pub fn remove() -> Result<(), NftError> {
    match run_nft(&["delete", "table", TABLE_FAMILY, TABLE_NAME], None) {
        Err(NftError::Refused(text)) if text.contains("No such file or directory") => Ok(()),
        other => other,
    }
}

fn run_nft(args: &[&str], stdin: Option<&str>) -> Result<(), NftError> {
    let mut child = NFT
        .command()
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftError::Spawn)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(NftError::Spawn)?;
    }
    let output = child.wait_with_output().map_err(NftError::Spawn)?;
    if output.status.success() {
        Ok(())
    } else {
        Err(NftError::Refused(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::map::Capture;

    #[test]
    fn renders_one_atomic_transaction_with_our_table_only() {
        let map = CaptureMap::new(
            vec![
                Capture::parse("10.96.0.1:443=10.222.1.10:6443").unwrap(),
                Capture::parse("[fd00:10:96::1]:443=[fd00:222::10]:6443").unwrap(),
            ],
            true,
        )
        .unwrap();
        let expected = "\
add table inet konnectivity
delete table inet konnectivity
table inet konnectivity {
  chain output {
    type nat hook output priority -110; policy accept;
    meta mark 0x4b4e return
    ip daddr 10.96.0.1 tcp dport 443 redirect to :15443
    ip6 daddr fd00:10:96::1 tcp dport 443 redirect to :15443
    ip daddr 10.222.1.10 tcp dport 6443 redirect to :15443
    ip6 daddr fd00:222::10 tcp dport 6443 redirect to :15443
  }
}
";
        assert_eq!(render(&map, 15443, 0x4b4e), expected);
    }
}
