//! Waiting between reconnection attempts.

use std::time::Duration;

/// Reconnection backoff as upstream's: start at --sync-interval, grow ×1.5
/// per failure, never beyond --sync-interval-cap.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, cap: Duration) -> Self {
        Backoff {
            initial,
            cap,
            next: initial,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.mul_f64(1.5).min(self.cap);
        delay
    }

    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_by_half_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(3));
        let delays: Vec<_> = (0..5).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [1000, 1500, 2250, 3000, 3000]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_secs(1));
    }
}
