//! Backend selection strategies (`--proxy-strategies`), as upstream defines
//! them. Strategies are tried in the order given; one that finds no backend
//! hands over to the next.

use std::sync::Arc;

use rand::Rng;

use super::Backend;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Any agent.
    Default,
    /// An agent whose `host=`, `ipv4=` or `ipv6=` identifier equals the dial host.
    DestHost,
    /// An agent that announced `default-route=true`.
    DefaultRoute,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Default => "default",
            Strategy::DestHost => "destHost",
            Strategy::DefaultRoute => "defaultRoute",
        }
    }

    /// Whether this strategy could choose `backend` for some dial.
    pub fn can_choose(self, backend: &Backend) -> bool {
        let ids = backend.identifiers();
        match self {
            Strategy::Default => true,
            Strategy::DestHost => !(ids.hosts.is_empty() && ids.ipv4.is_empty() && ids.ipv6.is_empty()),
            Strategy::DefaultRoute => ids.default_route,
        }
    }

    fn admits(self, backend: &Backend, host: &str) -> bool {
        match self {
            Strategy::Default => true,
            Strategy::DestHost => backend.identifiers().matches_host(host),
            Strategy::DefaultRoute => backend.identifiers().default_route,
        }
    }
}

/// Parses the comma-separated flag value; unknown or repeated names are errors.
pub fn parse_strategies(text: &str) -> Result<Vec<Strategy>, String> {
    let mut strategies = Vec::new();
    for name in text.split(',').map(str::trim) {
        let strategy = match name {
            "default" => Strategy::Default,
            "destHost" => Strategy::DestHost,
            "defaultRoute" => Strategy::DefaultRoute,
            "" => return Err(format!("{text:?} has an empty strategy name")),
            other => {
                return Err(format!(
                    "unknown proxy strategy {other:?} (known: default, destHost, defaultRoute)"
                ));
            }
        };
        if strategies.contains(&strategy) {
            return Err(format!("proxy strategy {name:?} is listed twice"));
        }
        strategies.push(strategy);
    }
    Ok(strategies)
}

/// Marks which of `agent_id`'s streams may be chosen: only its oldest that
/// does not drain (its oldest, when all drain). An agent holding streams to
/// several servers behind one address dials until it reaches each of them,
/// and a stream that lands on a server it already holds is closed at once:
/// a dial routed to that newcomer would fail with it. Every agent also gets
/// an equal share of dials, however many streams it has open. A draining
/// stream gives way to a younger one of the same id: the agent that
/// replaces its predecessor on a node, with the same `--agent-id`, takes
/// the node's dials while the predecessor's stream (or, after a hand-over,
/// the successor resuming it) carries only what it already had. Called when
/// streams come and go or start to drain, so that choosing, once per dial,
/// needs no grouping.
pub(crate) fn mark_oldest(backends: &[Arc<Backend>], agent_id: &str) {
    let streams = || backends.iter().filter(|b| b.agent_id == agent_id);
    let oldest_serving = streams().filter(|b| !b.is_draining()).map(|b| b.id.0).min();
    let Some(oldest) = oldest_serving.or_else(|| streams().map(|b| b.id.0).min()) else {
        return;
    };
    for backend in streams() {
        backend
            .younger
            .store(backend.id.0 != oldest, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Picks a backend for a dial to `host` among `backends`:
/// within the first strategy that has candidates, a random one that is not
/// draining, or a draining one when all candidates drain (so a draining
/// fleet still serves). Counts, then walks to the chosen one: no allocation
/// or hashing per dial, whatever the number of agents.
pub(crate) fn select(strategies: &[Strategy], backends: &[Arc<Backend>], host: &str) -> Option<Arc<Backend>> {
    let mut rng = rand::rng();
    for strategy in strategies {
        let candidate = |b: &&Arc<Backend>| !b.is_younger_stream() && strategy.admits(b, host);
        let serving = |b: &&Arc<Backend>| candidate(b) && !b.is_draining();
        let count = backends.iter().filter(serving).count();
        let chosen = if count > 0 {
            backends.iter().filter(serving).nth(rng.random_range(0..count))
        } else {
            let count = backends.iter().filter(candidate).count();
            if count == 0 {
                continue;
            }
            backends.iter().filter(candidate).nth(rng.random_range(0..count))
        };
        return chosen.cloned();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Announced, BackendId};
    use konnectivity_proto::AgentIdentifiers;

    fn backend(id: u64, identifiers: &str) -> Arc<Backend> {
        stream_of(&format!("agent-{id}"), id, identifiers)
    }

    /// Stream `id` of the agent `agent_id`.
    fn stream_of(agent_id: &str, id: u64, identifiers: &str) -> Arc<Backend> {
        let announced = Announced {
            agent_id: agent_id.to_owned(),
            identifiers: AgentIdentifiers::parse(identifiers).unwrap(),
            ..Announced::default()
        };
        let metrics = Arc::new(crate::metrics::ServerMetrics::default());
        Backend::open(BackendId(id), announced, metrics).0
    }

    #[test]
    fn parses_upstream_names_in_order() {
        assert_eq!(
            parse_strategies("destHost,default").unwrap(),
            [Strategy::DestHost, Strategy::Default]
        );
        assert!(parse_strategies("destCIDR").unwrap_err().contains("destCIDR"));
        assert!(parse_strategies("default,default").is_err());
        assert!(parse_strategies("").is_err());
    }

    #[test]
    fn dest_host_picks_the_matching_agent_then_falls_back() {
        let backends = [backend(1, "ipv4=10.0.0.4"), backend(2, "ipv4=10.0.0.5")];
        let strategies = [Strategy::DestHost, Strategy::Default];
        for _ in 0..20 {
            let chosen = select(&strategies, &backends, "10.0.0.5").unwrap();
            assert_eq!(chosen.id, BackendId(2));
        }
        assert!(select(&strategies, &backends, "10.9.9.9").is_some());
        assert!(select(&[Strategy::DestHost], &backends, "10.9.9.9").is_none());
    }

    #[test]
    fn a_newer_stream_of_the_same_agent_is_not_chosen() {
        let backends = [
            stream_of("a", 7, ""),
            stream_of("a", 3, ""),
            stream_of("a", 9, ""),
            stream_of("b", 5, ""),
        ];
        mark_oldest(&backends, "a");
        mark_oldest(&backends, "b");
        let mut chosen = std::collections::BTreeSet::new();
        for _ in 0..100 {
            chosen.insert(select(&[Strategy::Default], &backends, "x").unwrap().id.0);
        }
        assert_eq!(chosen, [3, 5].into());
        // The oldest gone, the next oldest serves.
        let rest = [backends[0].clone(), backends[2].clone()];
        mark_oldest(&rest, "a");
        assert_eq!(select(&[Strategy::Default], &rest, "x").unwrap().id, BackendId(7));
    }

    /// An agent replaced on its node keeps its id: once the old stream
    /// drains, the new one is chosen, and the old one again only if the new
    /// one drains too.
    #[test]
    fn a_draining_stream_gives_way_to_a_younger_one_of_the_same_agent() {
        let backends = [stream_of("a", 3, ""), stream_of("a", 8, "")];
        mark_oldest(&backends, "a");
        assert_eq!(
            select(&[Strategy::Default], &backends, "x").unwrap().id,
            BackendId(3)
        );
        backends[0].set_draining();
        mark_oldest(&backends, "a");
        for _ in 0..20 {
            assert_eq!(
                select(&[Strategy::Default], &backends, "x").unwrap().id,
                BackendId(8)
            );
        }
        backends[1].set_draining();
        mark_oldest(&backends, "a");
        assert_eq!(
            select(&[Strategy::Default], &backends, "x").unwrap().id,
            BackendId(3)
        );
    }

    #[test]
    fn default_route_needs_the_identifier() {
        let backends = [backend(1, ""), backend(2, "default-route=true")];
        let chosen = select(&[Strategy::DefaultRoute], &backends, "x").unwrap();
        assert_eq!(chosen.id, BackendId(2));
    }

    #[test]
    fn draining_agents_are_chosen_only_when_all_drain() {
        let backends = [backend(1, ""), backend(2, "")];
        backends[0].set_draining();
        for _ in 0..20 {
            assert_eq!(
                select(&[Strategy::Default], &backends, "x").unwrap().id,
                BackendId(2)
            );
        }
        backends[1].set_draining();
        assert!(select(&[Strategy::Default], &backends, "x").is_some());
    }

    #[test]
    fn no_backends_selects_nothing() {
        assert!(select(&[Strategy::Default], &[], "x").is_none());
    }
}
