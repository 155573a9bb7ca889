//! The `agentidentifiers` metadata value: a URL query string naming what an
//! agent can reach, e.g. `host=node1&ipv4=10.0.0.5&default-route=true`.
//! Servers route `destHost` and `defaultRoute` dials by it.

use std::fmt;

/// What an agent announces about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentIdentifiers {
    pub hosts: Vec<String>,
    pub ipv4: Vec<String>,
    pub ipv6: Vec<String>,
    pub cidrs: Vec<String>,
    pub default_route: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentifiersError {
    #[error("unknown agent identifier key {0:?} (known: host, ipv4, ipv6, cidr, default-route)")]
    UnknownKey(String),
    #[error("agent identifier {0:?} has no value")]
    MissingValue(String),
    #[error(
        "agent identifier {0}= has an empty value (in a manifest, the variable it is made from, \
         such as $(HOST_IP), is probably unset)"
    )]
    EmptyValue(String),
    #[error("agent identifier default-route={0:?} is not true or false")]
    BadDefaultRoute(String),
    #[error("agent identifier {key}={value:?} is not valid percent-encoding")]
    BadEncoding { key: String, value: String },
}

impl AgentIdentifiers {
    /// Parses strictly, as upstream agents do for their own flag: an unknown
    /// key is an error naming it.
    pub fn parse(text: &str) -> Result<Self, IdentifiersError> {
        Self::parse_with(text, true)
    }

    /// Parses as upstream servers do: unknown keys are skipped, so newer
    /// agents can announce more than this server knows.
    pub fn parse_lenient(text: &str) -> Result<Self, IdentifiersError> {
        Self::parse_with(text, false)
    }

    fn parse_with(text: &str, strict: bool) -> Result<Self, IdentifiersError> {
        let mut ids = AgentIdentifiers::default();
        for pair in text.split('&').filter(|p| !p.is_empty()) {
            let (key, raw) = pair
                .split_once('=')
                .ok_or_else(|| IdentifiersError::MissingValue(pair.to_owned()))?;
            // An agent announcing `ipv4=` would match no dial; say so at
            // start-up. (Servers take what upstream agents send.)
            if strict && raw.is_empty() && key != "default-route" {
                return Err(IdentifiersError::EmptyValue(key.to_owned()));
            }
            let value = percent_decode(raw).ok_or_else(|| IdentifiersError::BadEncoding {
                key: key.to_owned(),
                value: raw.to_owned(),
            })?;
            match key {
                "host" => ids.hosts.push(value),
                "ipv4" => ids.ipv4.push(value),
                "ipv6" => ids.ipv6.push(value),
                "cidr" => ids.cidrs.push(value),
                "default-route" => {
                    ids.default_route = match value.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => return Err(IdentifiersError::BadDefaultRoute(value)),
                    }
                }
                unknown if strict => return Err(IdentifiersError::UnknownKey(unknown.to_owned())),
                _ => {}
            }
        }
        Ok(ids)
    }

    pub fn is_empty(&self) -> bool {
        *self == AgentIdentifiers::default()
    }

    /// Whether a dial's host ([`crate::DialTarget::host`]: an IP, IPv6
    /// without brackets, or a name) names this agent.
    pub fn matches_host(&self, host: &str) -> bool {
        self.ipv4.iter().any(|ip| ip == host)
            || self.ipv6.iter().any(|ip| ip == host)
            || self.hosts.iter().any(|h| h == host)
    }
}

impl fmt::Display for AgentIdentifiers {
    /// The query-string form sent as `agentidentifiers`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut pair = |f: &mut fmt::Formatter<'_>, key: &str, value: &str| {
            let sep = if first { "" } else { "&" };
            first = false;
            write!(f, "{sep}{key}={}", percent_encode(value))
        };
        for (key, values) in [
            ("host", &self.hosts),
            ("ipv4", &self.ipv4),
            ("ipv6", &self.ipv6),
            ("cidr", &self.cidrs),
        ] {
            for value in values {
                pair(f, key, value)?;
            }
        }
        if self.default_route {
            pair(f, "default-route", "true")?;
        }
        Ok(())
    }
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let ids = AgentIdentifiers::parse(
            "host=node-1&ipv4=10.0.0.5&ipv6=fd00%3A%3A5&cidr=10.0.0.0/24&default-route=true",
        )
        .unwrap();
        assert_eq!(ids.hosts, ["node-1"]);
        assert_eq!(ids.ipv4, ["10.0.0.5"]);
        assert_eq!(ids.ipv6, ["fd00::5"]);
        assert_eq!(ids.cidrs, ["10.0.0.0/24"]);
        assert!(ids.default_route);
    }

    #[test]
    fn an_empty_value_is_refused_in_strict_mode() {
        for text in ["ipv4=", "host=&ipv4=10.0.0.5", "cidr="] {
            let error = AgentIdentifiers::parse(text).unwrap_err();
            assert!(
                matches!(error, IdentifiersError::EmptyValue(_)),
                "{text}: {error}"
            );
            assert!(error.to_string().contains("empty value"), "{error}");
        }
        assert_eq!(AgentIdentifiers::parse_lenient("ipv4=").unwrap().ipv4, [""]);
    }

    #[test]
    fn unknown_key_is_named_in_strict_mode_and_skipped_in_lenient() {
        let err = AgentIdentifiers::parse("ipv4=1.2.3.4&zone=a").unwrap_err();
        assert_eq!(err, IdentifiersError::UnknownKey("zone".into()));
        assert!(err.to_string().contains("\"zone\""));
        let ids = AgentIdentifiers::parse_lenient("ipv4=1.2.3.4&zone=a").unwrap();
        assert_eq!(ids.ipv4, ["1.2.3.4"]);
    }

    #[test]
    fn malformed_values_are_errors() {
        assert!(AgentIdentifiers::parse("ipv4").is_err());
        assert!(AgentIdentifiers::parse("default-route=yes").is_err());
        assert!(AgentIdentifiers::parse("host=%zz").is_err());
        assert_eq!(AgentIdentifiers::parse(""), Ok(AgentIdentifiers::default()));
    }

    #[test]
    fn display_round_trips() {
        let text = "host=n1&ipv4=10.0.0.5&ipv6=fd00%3A%3A5&default-route=true";
        let ids = AgentIdentifiers::parse(text).unwrap();
        assert_eq!(ids.to_string(), text);
    }

    #[test]
    fn host_matching_handles_ipv6_brackets() {
        let ids = AgentIdentifiers::parse("ipv6=fd00%3A%3A5&host=node-1").unwrap();
        assert!(ids.matches_host(crate::DialTarget::new("[fd00::5]:443").host()));
        assert!(ids.matches_host("node-1"));
        assert!(!ids.matches_host("10.0.0.5"));
    }
}
