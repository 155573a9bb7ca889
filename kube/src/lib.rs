//! Just enough of a kube-apiserver client for what the proxy needs of it
//! (TokenReviews, Leases, Nodes): HTTPS with the credentials of a kubeconfig or of
//! the pod, JSON in and out, and watches that stream one event per line.

mod client;
mod config;
mod error;
pub mod lease;
pub mod node;
mod rate;
pub mod reflector;
mod selector;
mod watch;

pub use client::KubeClient;
pub use config::{Credentials, KubeConfigError, KubeEndpoint};
pub use error::KubeError;
pub use rate::RateLimit;
pub use selector::{LabelSelector, SelectorError, check_label, parse_labels};
pub use watch::{WatchEvent, WatchStream};
