//! The protocol juggles several int64s; these newtypes keep them apart.

use std::fmt;

/// A connection's id on one agent stream, allocated by the agent from 1 up.
/// 0 means "no connection" on the wire and is never a valid id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectId(i64);

impl ConnectId {
    /// The first id an agent hands out on a fresh stream.
    pub const FIRST: ConnectId = ConnectId(1);

    /// Accepts only positive values: what an agent may allocate.
    pub fn new(raw: i64) -> Option<Self> {
        (raw > 0).then_some(ConnectId(raw))
    }

    pub fn get(self) -> i64 {
        self.0
    }

    /// The id after this one (ids are never reused on a stream).
    pub fn next(self) -> Self {
        ConnectId(self.0.checked_add(1).expect("connect id space exhausted"))
    }
}

impl fmt::Display for ConnectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The `random` field: chosen by whoever dials, echoed in the response, and
/// the dial's identity until a [`ConnectId`] exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DialId(i64);

impl DialId {
    pub fn new(raw: i64) -> Self {
        DialId(raw)
    }

    /// A fresh random id, as upstream dialers pick them.
    pub fn random() -> Self {
        DialId(rand_i64())
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for DialId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A random i64 without pulling a RNG crate into the protocol crate: the
/// standard library's randomly keyed SipHash over a process-wide counter.
pub(crate) fn rand_i64() -> i64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static STATE: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
    let mut hasher = STATE.get_or_init(RandomState::new).build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_id_rejects_zero_and_negative() {
        assert_eq!(ConnectId::new(0), None);
        assert_eq!(ConnectId::new(-4), None);
        assert_eq!(ConnectId::new(1), Some(ConnectId::FIRST));
        assert_eq!(ConnectId::FIRST.next().get(), 2);
    }

    #[test]
    fn random_dial_ids_differ() {
        let ids: std::collections::HashSet<_> = (0..1000).map(|_| DialId::random()).collect();
        assert_eq!(ids.len(), 1000);
    }
}
