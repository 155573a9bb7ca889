//! A cap on how many of something may be open at once, set by a flag:
//! taking a slot either succeeds at once or fails with an error naming the
//! flag, so one request over the limit is refused cleanly and nothing waits.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

#[derive(Clone, Debug)]
pub struct Limit {
    slots: Arc<Semaphore>,
    max: usize,
    flag: &'static str,
}

/// One taken slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot(#[allow(dead_code)] OwnedSemaphorePermit);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} limit reached: {max} already open (--{flag}={max})")]
pub struct LimitReached {
    pub what: &'static str,
    pub max: usize,
    pub flag: &'static str,
}

impl Limit {
    /// `max` slots for `--flag`; 0 means no limit (`None`).
    pub fn from_flag(flag: &'static str, max: usize) -> Option<Limit> {
        (max > 0).then(|| Limit {
            slots: Arc::new(Semaphore::new(max)),
            max,
            flag,
        })
    }

    /// Takes a slot for one `what` (named in the error), without waiting.
    pub fn take(&self, what: &'static str) -> Result<Slot, LimitReached> {
        self.slots
            .clone()
            .try_acquire_owned()
            .map(Slot)
            .map_err(|_| LimitReached {
                what,
                max: self.max,
                flag: self.flag,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_and_come_back() {
        assert!(Limit::from_flag("max-things", 0).is_none());
        let limit = Limit::from_flag("max-things", 2).unwrap();
        let first = limit.take("thing").unwrap();
        let _second = limit.take("thing").unwrap();
        let refused = limit.take("thing").unwrap_err();
        assert_eq!(
            refused.to_string(),
            "thing limit reached: 2 already open (--max-things=2)"
        );
        drop(first);
        assert!(limit.take("thing").is_ok());
    }
}
