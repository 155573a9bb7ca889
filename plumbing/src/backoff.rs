//! Waiting between reconnection attempts.

use std::time::Duration;

use rand::Rng;

/// How much later than its step a wait may end, as a fraction of the step:
/// upstream's `wait.Backoff{Jitter: 0.1}`. Without it, thousands of agents
/// that lost their server at the same moment retry in lockstep, each wave
/// landing on the same server or balancer backend at the same instant.
pub const JITTER: f64 = 0.1;

/// Reconnection backoff as upstream's: start at --sync-interval, grow ×1.5
/// per failure, never beyond --sync-interval-cap; each wait up to
/// [`JITTER`] longer than its step, at random.
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

    /// The next wait: this step, jittered; the step after grows.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = self.next.mul_f64(1.5).min(self.cap);
        step.mul_f64(1.0 + JITTER * rand::rng().random::<f64>())
    }

    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each wait is its step (×1.5 per failure, up to the cap) and at most
    /// a tenth more.
    fn assert_steps(backoff: &mut Backoff, steps_ms: &[u64]) {
        for &step in steps_ms {
            let delay = backoff.next_delay().as_secs_f64() * 1000.0;
            let step = step as f64;
            assert!(
                delay >= step && delay <= step * (1.0 + JITTER) + 0.001,
                "a wait of {delay} ms for a step of {step} ms"
            );
        }
    }

    #[test]
    fn backoff_grows_by_half_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(3));
        assert_steps(&mut backoff, &[1000, 1500, 2250, 3000, 3000]);
        backoff.reset();
        assert_steps(&mut backoff, &[1000]);
    }

    /// Agents that lost their server together spread their retries out.
    #[test]
    fn waits_of_the_same_step_differ() {
        let waits: std::collections::BTreeSet<Duration> = (0..50)
            .map(|_| Backoff::new(Duration::from_secs(1), Duration::from_secs(10)).next_delay())
            .collect();
        assert!(
            waits.len() > 40,
            "50 first waits took only {} values",
            waits.len()
        );
    }
}
