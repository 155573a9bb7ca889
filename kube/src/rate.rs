//! client-go's client-side rate limit (`QPS` and `Burst` of a
//! `rest.Config`, which upstream's proxy-server sets from
//! `--kubeconfig-qps` and `--kubeconfig-burst`): a token bucket holding at
//! most `burst` requests that refills at `qps` per second; a request that
//! finds it empty waits for its turn. Every request to kube-apiserver takes
//! one, whichever part of the binary sends it: the bucket is shared.
//!
//! One deliberate difference: a QPS of 0 (the flag's default) is no limit,
//! where client-go takes its default of 5 per second. TokenReviews are cached
//! and shared here, so kube-apiserver sees one per distinct agent token, and
//! at 5 per second 1,000 agents reconnecting after a server restart would
//! wait 200 s to be admitted instead of about one.

use std::time::Duration;

use tokio::time::Instant;

/// client-go's default burst, for a burst left at 0 with a QPS set.
pub const DEFAULT_BURST: u32 = 10;

#[derive(Debug)]
pub struct RateLimit {
    qps: f64,
    burst: f64,
    bucket: std::sync::Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    /// Requests that may start now; below 0 when callers wait in line.
    tokens: f64,
    refilled: Instant,
}

impl RateLimit {
    /// The limit of `--kubeconfig-qps` and `--kubeconfig-burst`: none for a
    /// QPS of 0 or below; a burst of 0 takes client-go's default, 10.
    pub fn from_flags(qps: f32, burst: u32) -> Option<RateLimit> {
        if qps.is_nan() || qps <= 0.0 {
            return None;
        }
        let burst = if burst == 0 { DEFAULT_BURST } else { burst };
        Some(RateLimit {
            qps: f64::from(qps),
            burst: f64::from(burst),
            bucket: std::sync::Mutex::new(Bucket {
                tokens: f64::from(burst),
                refilled: Instant::now(),
            }),
        })
    }

    /// Waits until this request may be sent.
    pub async fn acquire(&self) {
        let wait = {
            let mut bucket = self.bucket.lock().expect("rate limit lock");
            let now = Instant::now();
            let refill = now.duration_since(bucket.refilled).as_secs_f64() * self.qps;
            bucket.tokens = (bucket.tokens + refill).min(self.burst);
            bucket.refilled = now;
            // Taken now, so that callers after this one line up behind it.
            bucket.tokens -= 1.0;
            if bucket.tokens >= 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(-bucket.tokens / self.qps)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_qps_is_no_limit_and_no_burst_is_client_gos_default() {
        assert!(RateLimit::from_flags(0.0, 5).is_none());
        assert!(RateLimit::from_flags(-1.0, 0).is_none());
        let limit = RateLimit::from_flags(2.5, 0).unwrap();
        assert_eq!((limit.qps, limit.burst), (2.5, 10.0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_passes_at_once_and_the_rest_at_the_rate() {
        let limit = RateLimit::from_flags(2.0, 3).unwrap();
        let started = Instant::now();
        let mut admitted = Vec::new();
        for _ in 0..7 {
            limit.acquire().await;
            admitted.push(started.elapsed());
        }
        let ms: Vec<u128> = admitted.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [0, 0, 0, 500, 1000, 1500, 2000]);
    }
}
