//! The node-traffic policy: node agents' captured connections may reach
//! only the API server endpoints the operator allowed, and only through
//! control-plane agents; ordinary egress never uses control-plane agents.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use konnectivity_proto::DialTarget;

/// Who is dialing, which decides the backends and destinations allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontendClass {
    /// kube-apiserver's egress (the UDS or the mTLS TCP frontend).
    Apiserver,
    /// Node agents tunneling captured connections (the node frontend).
    Node,
}

impl FrontendClass {
    /// The `frontend` label of metrics.
    pub fn label(self) -> &'static str {
        match self {
            FrontendClass::Apiserver => "apiserver",
            FrontendClass::Node => "node",
        }
    }
}

/// One entry of `--node-allowed-destinations`: an address or CIDR and a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedDestination {
    pub net: IpNet,
    pub port: u16,
}

impl AllowedDestination {
    /// Parses `IP:PORT`, `CIDR:PORT`, `[IPv6]:PORT` or `[IPv6-CIDR]:PORT`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{text:?}: {why} (expected IP:PORT or CIDR:PORT)");
        let (host, port) = text.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("invalid port"))?;
        let host = match host.strip_prefix('[') {
            Some(inner) => inner.strip_suffix(']').ok_or_else(|| bad("unclosed bracket"))?,
            None if host.contains(':') => return Err(bad("IPv6 addresses need brackets")),
            None => host,
        };
        let net = if host.contains('/') {
            host.parse::<IpNet>().map_err(|_| bad("invalid CIDR"))?.trunc()
        } else {
            IpNet::from(host.parse::<IpAddr>().map_err(|_| bad("invalid IP address"))?)
        };
        Ok(AllowedDestination { net, port })
    }

    fn admits(&self, addr: SocketAddr) -> bool {
        self.port == addr.port() && self.net.contains(&addr.ip())
    }
}

impl fmt::Display for AllowedDestination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.net {
            IpNet::V4(net) if net.prefix_len() == 32 => write!(f, "{}:{}", net.addr(), self.port),
            IpNet::V6(net) if net.prefix_len() == 128 => write!(f, "[{}]:{}", net.addr(), self.port),
            IpNet::V4(net) => write!(f, "{net}:{}", self.port),
            IpNet::V6(net) => write!(f, "[{net}]:{}", self.port),
        }
    }
}

/// Parses the comma-separated `--node-allowed-destinations` value.
pub fn parse_allowed(text: &str) -> Result<Vec<AllowedDestination>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(AllowedDestination::parse)
        .collect()
}

/// Why the policy refused a node dial. The text reaches the node agent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("node clients may dial only IP:PORT destinations, not {0:?} (node-traffic policy)")]
    NotAnAddress(String),
    #[error(
        "destination {0} is not allowed for node clients (node-traffic policy, --node-allowed-destinations)"
    )]
    NotAllowed(SocketAddr),
}

/// Checks a node client's dial address against the allow-list.
pub(crate) fn check_node_destination(
    allowed: &[AllowedDestination],
    address: &DialTarget,
) -> Result<(), PolicyError> {
    let addr = address
        .socket_addr()
        .ok_or_else(|| PolicyError::NotAnAddress(address.to_string()))?;
    if allowed.iter().any(|entry| entry.admits(addr)) {
        Ok(())
    } else {
        Err(PolicyError::NotAllowed(addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addresses_and_cidrs_with_ports() {
        let allowed =
            parse_allowed("10.222.1.10:6443, 10.0.0.0/24:443,[fd00::1]:6443,[fd00::/64]:443").unwrap();
        assert_eq!(allowed.len(), 4);
        assert_eq!(allowed[0].to_string(), "10.222.1.10:6443");
        assert_eq!(allowed[1].to_string(), "10.0.0.0/24:443");
        assert_eq!(allowed[2].to_string(), "[fd00::1]:6443");
        assert_eq!(allowed[3].to_string(), "[fd00::/64]:443");
    }

    #[test]
    fn rejects_malformed_entries_naming_them() {
        for bad in [
            "10.0.0.1",
            "10.0.0.1:0",
            "10.0.0.1:x",
            "fd00::1:443",
            "[fd00::1:443",
            "host:443",
            "10.0.0.0/33:1",
        ] {
            let error = parse_allowed(bad).unwrap_err();
            assert!(error.contains(bad), "{error}");
        }
    }

    #[test]
    fn admits_only_listed_address_and_port() {
        let allowed = parse_allowed("10.222.1.10:6443,10.0.0.0/24:443,[fd00::/64]:443").unwrap();
        assert_eq!(
            check_node_destination(&allowed, &DialTarget::from("10.222.1.10:6443")),
            Ok(())
        );
        assert_eq!(
            check_node_destination(&allowed, &DialTarget::from("10.0.0.77:443")),
            Ok(())
        );
        assert_eq!(
            check_node_destination(&allowed, &DialTarget::from("[fd00::9]:443")),
            Ok(())
        );
        assert!(matches!(
            check_node_destination(&allowed, &DialTarget::from("10.222.1.10:22")),
            Err(PolicyError::NotAllowed(_))
        ));
        assert!(matches!(
            check_node_destination(&allowed, &DialTarget::from("10.0.1.1:443")),
            Err(PolicyError::NotAllowed(_))
        ));
        assert!(matches!(
            check_node_destination(&allowed, &DialTarget::from("kubernetes.default:443")),
            Err(PolicyError::NotAnAddress(_))
        ));
    }
}
