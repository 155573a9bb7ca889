//! A dial's destination, as a client names it and DIAL_REQ carries it.

use std::fmt;
use std::net::SocketAddr;

/// `host:port`, parsed once where it enters: by the frontends (the server
/// picks an agent by its host and checks node dials against the policy) and
/// by the agent (which dials it). The text travels unchanged: the gRPC
/// frontend passes on whatever its client sent, as upstream's does, and the
/// agent's dial then says what is wrong with it in Go's words.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DialTarget {
    /// Only the text: it is split where asked (a `rfind`), so a target is no
    /// larger than the string in every tunnel's state.
    text: String,
}

/// Why a target does not have the shape a dial needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("missing port in address")]
    MissingPort,
    #[error("invalid port")]
    InvalidPort,
    #[error("invalid host")]
    InvalidHost,
}

impl DialTarget {
    pub fn new(text: impl Into<String>) -> DialTarget {
        DialTarget { text: text.into() }
    }

    /// Parses a target that must be well formed, as an HTTP CONNECT request's
    /// is: a non-empty host without spaces, slashes or `@` (an IPv6 address in
    /// brackets) and a port from 1 to 65535.
    pub fn parse_strict(text: &str) -> Result<DialTarget, TargetError> {
        let target = DialTarget::new(text);
        let (host, port) = target.raw_parts().ok_or(TargetError::MissingPort)?;
        if !port.parse::<u16>().is_ok_and(|port| port != 0) {
            return Err(TargetError::InvalidPort);
        }
        let bracketed = host.starts_with('[') && host.ends_with(']');
        if host.is_empty() || (host.contains(':') && !bracketed) || host.contains(['/', ' ', '@']) {
            return Err(TargetError::InvalidHost);
        }
        Ok(target)
    }

    /// The text as the client sent it.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Host and port text, split at the last `:`, the host as written.
    fn raw_parts(&self) -> Option<(&str, &str)> {
        self.text.rsplit_once(':')
    }

    /// The host without an IPv6 literal's brackets; the whole text when
    /// there is no port.
    pub fn host(&self) -> &str {
        let host = self.raw_parts().map_or(self.text.as_str(), |(host, _)| host);
        host.strip_prefix('[')
            .and_then(|inner| inner.strip_suffix(']'))
            .unwrap_or(host)
    }

    /// The port.
    pub fn port(&self) -> Result<u16, TargetError> {
        let (_, port) = self.raw_parts().ok_or(TargetError::MissingPort)?;
        port.parse().map_err(|_| TargetError::InvalidPort)
    }

    /// The target as an IP address and port, when it is one (node clients may
    /// dial nothing else).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.text.parse().ok()
    }
}

impl fmt::Display for DialTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl From<String> for DialTarget {
    fn from(text: String) -> Self {
        DialTarget::new(text)
    }
}

impl From<&str> for DialTarget {
    fn from(text: &str) -> Self {
        DialTarget::new(text)
    }
}

impl From<DialTarget> for String {
    fn from(target: DialTarget) -> Self {
        target.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_ports_are_split_once_brackets_and_all() {
        let v4 = DialTarget::new("10.0.0.1:443");
        assert_eq!((v4.host(), v4.port()), ("10.0.0.1", Ok(443)));
        assert_eq!(v4.socket_addr(), Some("10.0.0.1:443".parse().unwrap()));
        let v6 = DialTarget::new("[fd00::1]:6443");
        assert_eq!((v6.host(), v6.port()), ("fd00::1", Ok(6443)));
        assert!(v6.socket_addr().is_some());
        let name = DialTarget::new("kubernetes.default:443");
        assert_eq!((name.host(), name.port()), ("kubernetes.default", Ok(443)));
        assert_eq!(name.socket_addr(), None);
        assert_eq!(name.to_string(), "kubernetes.default:443");
    }

    #[test]
    fn malformed_targets_travel_unchanged_and_say_what_is_missing() {
        let bare = DialTarget::new("10.0.0.1");
        assert_eq!(bare.host(), "10.0.0.1");
        assert_eq!(bare.port(), Err(TargetError::MissingPort));
        assert_eq!(DialTarget::new("host:http").port(), Err(TargetError::InvalidPort));
        assert_eq!(DialTarget::new("host:http").as_str(), "host:http");
    }

    #[test]
    fn connect_targets_must_be_well_formed() {
        for good in ["10.0.0.1:443", "[fd00::1]:443", "my-svc.ns.svc:8080"] {
            assert!(DialTarget::parse_strict(good).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("10.0.0.1", TargetError::MissingPort),
            ("10.0.0.1:0", TargetError::InvalidPort),
            ("10.0.0.1:65536", TargetError::InvalidPort),
            (":443", TargetError::InvalidHost),
            ("fd00::1:443", TargetError::InvalidHost),
            ("user@host:443", TargetError::InvalidHost),
            ("a/b:443", TargetError::InvalidHost),
        ] {
            assert_eq!(DialTarget::parse_strict(bad), Err(why), "{bad}");
        }
    }
}
