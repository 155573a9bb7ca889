//! How tunnels end, the same on both binaries: `tunnels_ended_total{reason}`
//! counts every dial exactly once, established or not, and at -v=2 each end
//! is logged inside the tunnel's span (whose ids match across the server and
//! the agent). Each binary says what its reasons are ([`EndReason`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::metrics::counter::GoCounter;
use crate::metrics::registry::{Labels, register};

/// HELP of `tunnels_ended_total`.
pub const TUNNELS_ENDED_HELP: &str = "Tunnels ended, by reason: who or what ended them, before or after they were established (docs/metrics.md).";

/// Why a tunnel ended, as one binary names it.
pub trait EndReason: Copy {
    /// The `reason` label (docs/metrics.md lists them).
    fn label(self) -> &'static str;
}

/// `tunnels_ended_total{reason}`.
#[derive(Debug, Clone, Default)]
pub struct TunnelsEnded(Family<Labels, GoCounter>);

impl TunnelsEnded {
    pub fn register(registry: &mut Registry) -> TunnelsEnded {
        let family = Family::<Labels, GoCounter>::default();
        register(
            registry,
            "tunnels_ended_total",
            TUNNELS_ENDED_HELP,
            family.clone(),
        );
        TunnelsEnded(family)
    }

    fn count(&self, reason: impl EndReason) {
        self.0.get_or_create(&vec![("reason", reason.label())]).inc();
    }

    /// A tunnel ended before it was established: counted, and logged in its
    /// span with the error, if there was one (formatted only if logged).
    pub fn before_established(
        &self,
        tunnel: &tracing::Span,
        reason: impl EndReason,
        error: Option<&dyn std::fmt::Display>,
    ) {
        self.count(reason);
        tunnel.in_scope(|| {
            let error = error.map(tracing::field::display);
            tracing::debug!(
                reason = reason.label(),
                error,
                "tunnel ended before it was established"
            )
        });
    }

    /// The record of a tunnel established now, which counts and logs its end
    /// when dropped; until told otherwise, it ended for `end`.
    pub fn established<R: EndReason>(
        &self,
        tunnel: tracing::Span,
        bytes: Arc<TunnelBytes>,
        end: R,
    ) -> TunnelRecord<R> {
        tunnel.in_scope(|| tracing::debug!("tunnel established"));
        TunnelRecord {
            ended: self.clone(),
            tunnel,
            started: Instant::now(),
            bytes,
            end,
        }
    }
}

/// An established tunnel, from its start to its end: dropping it counts the
/// end and logs "tunnel closed" with the reason, the bytes each way and how
/// long it lasted.
#[derive(Debug)]
pub struct TunnelRecord<R: EndReason> {
    ended: TunnelsEnded,
    tunnel: tracing::Span,
    started: Instant,
    bytes: Arc<TunnelBytes>,
    end: R,
}

impl<R: EndReason> TunnelRecord<R> {
    /// The tunnel ended for `reason`.
    pub fn end(mut self, reason: R) {
        self.end = reason;
    }

    /// Says why the tunnel will have ended, for whoever drops the record.
    pub fn set_end(&mut self, reason: R) {
        self.end = reason;
    }

    /// The tunnel's span, with its ids.
    pub fn span(&self) -> &tracing::Span {
        &self.tunnel
    }
}

impl<R: EndReason> Drop for TunnelRecord<R> {
    fn drop(&mut self) {
        self.ended.count(self.end);
        let _tunnel = self.tunnel.enter();
        tracing::debug!(
            reason = self.end.label(),
            bytes_to_target = self.bytes.to_target(),
            bytes_from_target = self.bytes.from_target(),
            duration = ?self.started.elapsed(),
            "tunnel closed"
        );
    }
}

/// Bytes through one tunnel, each way: counted where they pass (the
/// server's tunnel halves, the agent's endpoint tasks) and read once, when
/// the tunnel's end is logged.
#[derive(Debug, Default)]
pub struct TunnelBytes {
    to_target: AtomicU64,
    from_target: AtomicU64,
}

impl TunnelBytes {
    pub fn sent_to_target(&self, bytes: usize) {
        self.to_target.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn received_from_target(&self, bytes: usize) {
        self.from_target.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn to_target(&self) -> u64 {
        self.to_target.load(Ordering::Relaxed)
    }

    pub fn from_target(&self) -> u64 {
        self.from_target.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy)]
    enum End {
        Early,
        Late,
    }

    impl EndReason for End {
        fn label(self) -> &'static str {
            match self {
                End::Early => "early",
                End::Late => "late",
            }
        }
    }

    #[test]
    fn every_tunnel_is_counted_once_under_its_final_reason() {
        let mut registry = Registry::default();
        let ended = TunnelsEnded::register(&mut registry);
        let reason = |label| ended.0.get_or_create(&vec![("reason", label)]).get();
        ended.before_established(&tracing::Span::none(), End::Early, Some(&"refused"));
        let record = ended.established(tracing::Span::none(), Arc::default(), End::Early);
        assert_eq!(
            (reason("early"), reason("late")),
            (1, 0),
            "counted at its end, not before"
        );
        record.end(End::Late);
        let mut record = ended.established(tracing::Span::none(), Arc::default(), End::Early);
        record.set_end(End::Late);
        drop(record);
        assert_eq!((reason("early"), reason("late")), (1, 2));
    }
}
