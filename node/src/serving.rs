//! A listening socket and the task that accepts on it, kept apart: the task
//! can stop while the socket lives on (passed to the agent that replaces
//! this one, which accepts on the very same socket, so nothing queued on it
//! is lost).

use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use tokio::task::AbortHandle;

pub(crate) struct Serving<L> {
    listener: Arc<L>,
    task: AbortHandle,
}

impl<L: Send + Sync + 'static> Serving<L> {
    /// Starts `serve` on `listener`.
    pub(crate) fn start<F>(listener: L, serve: impl FnOnce(Arc<L>) -> F) -> Serving<L>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let listener = Arc::new(listener);
        let task = tokio::spawn(serve(listener.clone())).abort_handle();
        Serving { listener, task }
    }

    /// Starts serving the same listener again after [`Serving::stop`].
    pub(crate) fn restart<F>(&mut self, serve: impl FnOnce(Arc<L>) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.task.abort();
        self.task = tokio::spawn(serve(self.listener.clone())).abort_handle();
    }

    /// Stops accepting; the socket stays open until this is dropped.
    pub(crate) fn stop(&self) {
        self.task.abort();
    }

    /// Whether the accepting task has ended (it never ends by itself).
    pub(crate) fn is_stopped(&self) -> bool {
        self.task.is_finished()
    }
}

impl<L: AsFd> Serving<L> {
    /// A descriptor of the listening socket, to pass to another process.
    pub(crate) fn duplicate(&self) -> std::io::Result<OwnedFd> {
        self.listener.as_fd().try_clone_to_owned()
    }
}

impl<L> Drop for Serving<L> {
    fn drop(&mut self) {
        self.task.abort();
    }
}
