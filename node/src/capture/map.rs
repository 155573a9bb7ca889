//! The capture map (`--capture VIP:PORT=TARGET:PORT`): which original
//! destinations the node agent captures, and where each is tunneled.
//!
//! Each target is captured too, as itself: eBPF service load balancers
//! (Cilium's socket-LB, Calico's eBPF data plane) rewrite the VIP to the
//! endpoint inside `connect()`, before any netfilter hook, so the first
//! packet the rules see is already addressed to the API server's endpoint.

use std::fmt;
use std::net::SocketAddr;

/// The destination a captured connection was addressed to, read back with
/// `SO_ORIGINAL_DST` after the REDIRECT rewrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OrigDst(pub SocketAddr);

impl fmt::Display for OrigDst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One `--capture` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capture {
    /// What local processes connect to: the service VIP and port, or the
    /// endpoint itself when something rewrote the VIP before our rules.
    pub destination: SocketAddr,
    /// What the control-plane agent dials for them (the API server endpoint).
    pub target: SocketAddr,
}

impl Capture {
    /// Parses `VIP:PORT=TARGET:PORT`; IPv6 addresses in brackets.
    pub fn parse(text: &str) -> Result<Capture, String> {
        let (vip, target) = text
            .split_once('=')
            .ok_or_else(|| format!("{text:?} is not VIP:PORT=TARGET:PORT"))?;
        let address = |part: &str, what: &str| {
            part.trim()
                .parse::<SocketAddr>()
                .map_err(|_| format!("{text:?}: {what} {part:?} is not IP:PORT ([IPv6]:PORT)"))
        };
        let capture = Capture {
            destination: address(vip, "VIP")?,
            target: address(target, "target")?,
        };
        if capture.destination.port() == 0 || capture.target.port() == 0 {
            return Err(format!("{text:?}: ports must not be 0"));
        }
        if capture.destination.ip().is_unspecified() || capture.destination.ip().is_loopback() {
            return Err(format!(
                "{text:?}: the VIP must be a specific, non-loopback address"
            ));
        }
        Ok(capture)
    }
}

/// All captures, looked up by original destination.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureMap(Vec<Capture>);

impl CaptureMap {
    /// The map of `captures`; with `endpoints`, each target is captured as
    /// itself too (unless it is a captured VIP already).
    pub fn new(captures: Vec<Capture>, endpoints: bool) -> Result<CaptureMap, String> {
        for (i, capture) in captures.iter().enumerate() {
            if captures[..i].iter().any(|c| c.destination == capture.destination) {
                return Err(format!("VIP {} is captured twice", capture.destination));
            }
        }
        let mut all = captures.clone();
        if endpoints {
            for capture in &captures {
                if !all.iter().any(|c| c.destination == capture.target) {
                    all.push(Capture {
                        destination: capture.target,
                        target: capture.target,
                    });
                }
            }
        }
        Ok(CaptureMap(all))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn entries(&self) -> &[Capture] {
        &self.0
    }

    /// Where a captured connection goes; `None` for a destination we do not
    /// capture (a stale rule, or a redirect by someone else): such a
    /// connection is closed, never forwarded.
    pub fn target_for(&self, orig: OrigDst) -> Option<SocketAddr> {
        self.0.iter().find(|c| c.destination == orig.0).map(|c| c.target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ipv4_and_ipv6_captures() {
        let v4 = Capture::parse("10.96.0.1:443=10.222.1.10:6443").unwrap();
        assert_eq!(v4.destination, "10.96.0.1:443".parse().unwrap());
        assert_eq!(v4.target, "10.222.1.10:6443".parse().unwrap());
        let v6 = Capture::parse("[fd00:10:96::1]:443=[fd00:222::10]:6443").unwrap();
        assert_eq!(v6.destination.port(), 443);
    }

    #[test]
    fn rejects_malformed_captures_naming_them() {
        for bad in [
            "10.96.0.1:443",
            "10.96.0.1=10.222.1.10:6443",
            "10.96.0.1:443=host:6443",
            "10.96.0.1:0=10.222.1.10:6443",
            "127.0.0.1:443=10.222.1.10:6443",
            "fd00::1:443=10.0.0.1:1",
        ] {
            let error = Capture::parse(bad).unwrap_err();
            assert!(error.contains(bad), "{error}");
        }
    }

    #[test]
    fn looks_up_targets_by_original_destination_only() {
        let map = CaptureMap::new(
            vec![Capture::parse("10.96.0.1:443=10.222.1.10:6443").unwrap()],
            false,
        )
        .unwrap();
        let hit = OrigDst("10.96.0.1:443".parse().unwrap());
        assert_eq!(map.target_for(hit), Some("10.222.1.10:6443".parse().unwrap()));
        assert_eq!(map.target_for(OrigDst("10.96.0.1:80".parse().unwrap())), None);
        assert_eq!(map.target_for(OrigDst("10.96.0.2:443".parse().unwrap())), None);
    }

    #[test]
    fn a_vip_captured_twice_is_an_error() {
        let twice = vec![
            Capture::parse("10.96.0.1:443=10.0.0.1:1").unwrap(),
            Capture::parse("10.96.0.1:443=10.0.0.2:1").unwrap(),
        ];
        assert!(
            CaptureMap::new(twice, true)
                .unwrap_err()
                .contains("10.96.0.1:443")
        );
    }

    #[test]
    fn each_target_is_captured_as_itself_too() {
        let captures = vec![
            Capture::parse("10.96.0.1:443=10.222.1.10:6443").unwrap(),
            Capture::parse("[fd00:96::1]:443=10.222.1.10:6443").unwrap(),
        ];
        let map = CaptureMap::new(captures, true).unwrap();
        let endpoint: SocketAddr = "10.222.1.10:6443".parse().unwrap();
        assert_eq!(map.target_for(OrigDst(endpoint)), Some(endpoint));
        assert_eq!(map.entries().len(), 3, "one endpoint entry for two VIPs: {map:?}");
        let without = CaptureMap::new(
            vec![Capture::parse("10.96.0.1:443=10.222.1.10:6443").unwrap()],
            false,
        )
        .unwrap();
        assert_eq!(without.target_for(OrigDst(endpoint)), None);
    }
}
