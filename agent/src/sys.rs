//! Operations on the process's namespaces. `setns` changes only the calling
//! thread, so it runs on a dedicated OS thread, never on a tokio worker.

use std::fs::File;
use std::path::Path;

use nix::sched::{CloneFlags, setns};

/// Runs `work` on a fresh thread that has entered the network namespace at
/// `netns` (a bind-mounted `/var/run/netns/NAME` or `/proc/PID/ns/net`).
/// Sockets it creates stay in that namespace after the thread ends; child
/// processes it spawns (nft) run in it too.
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

/// Brings the current network namespace's loopback device up with one
/// RTM_NEWLINK (set IFF_UP on `lo`), as `ip link set lo up` would, from the
/// calling thread: a netlink socket acts in the namespace it was opened in,
/// so call this on the thread [`in_netns`] runs (the image ships no `ip`).
pub fn set_loopback_up() -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    runtime.block_on(async {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        handle
            .link()
            .set(rtnetlink::LinkUnspec::new_with_name("lo").up().build())
            .execute()
            .await
            .map_err(|error| std::io::Error::other(format!("bringing lo up (RTM_NEWLINK): {error}")))
    })
}
