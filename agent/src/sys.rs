//! Operations on the process's namespaces. `setns` changes only the calling
//! thread, so it runs on a dedicated OS thread, never on a tokio worker.

use std::fs::File;
use std::path::Path;

use nix::sched::{CloneFlags, setns};

/// Runs `work` on a fresh thread that has entered the network namespace at
/// `netns` (a bind-mounted `/var/run/netns/NAME` or `/proc/PID/ns/net`).
/// Sockets it creates stay in that namespace after the thread ends; child
/// processes it spawns (nft, ip) run in it too.
pub fn in_netns<T, F>(netns: &Path, work: F) -> std::io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
{
    let file = File::open(netns)?;
    std::thread::spawn(move || {
        setns(&file, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        work()
    })
    .join()
    .map_err(|_| std::io::Error::other("network namespace worker panicked"))?
}
