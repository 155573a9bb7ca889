//! Operations on the process's namespaces. `setns` changes only the calling
//! thread, so it runs on a dedicated OS thread, never on a tokio worker.

use std::fs::File;
use std::path::Path;

use nix::sched::{CloneFlags, setns};

/// A network namespace held open by a descriptor: entering it later enters
/// this namespace, whatever its path names by then (a reused PID, a pin
/// made anew), and it stays alive while held.
#[derive(Clone, Debug)]
pub(crate) struct NetnsHandle {
    file: std::sync::Arc<File>,
    identity: (u64, u64),
}

impl NetnsHandle {
    /// Opens the namespace at `path` (a bind-mounted `/var/run/netns/NAME`
    /// or `/proc/PID/ns/net`).
    pub(crate) fn open(path: &Path) -> std::io::Result<NetnsHandle> {
        use std::os::unix::fs::MetadataExt;
        let file = File::open(path)?;
        let metadata = file.metadata()?;
        Ok(NetnsHandle {
            file: std::sync::Arc::new(file),
            identity: (metadata.dev(), metadata.ino()),
        })
    }

    /// A namespace already open (handed over by the agent before).
    pub(crate) fn from_file(file: File) -> std::io::Result<NetnsHandle> {
        use std::os::unix::fs::MetadataExt;
        let metadata = file.metadata()?;
        Ok(NetnsHandle {
            file: std::sync::Arc::new(file),
            identity: (metadata.dev(), metadata.ino()),
        })
    }

    /// A descriptor of the namespace, to pass to another process.
    pub(crate) fn duplicate(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        std::os::fd::AsFd::as_fd(&*self.file).try_clone_to_owned()
    }

    /// The namespace's device and inode, as `stat` of any path to it gives.
    pub(crate) fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// Runs `work` on a fresh thread that has entered the namespace.
    /// Sockets it creates stay in that namespace after the thread ends;
    /// child processes it spawns (nft) run in it too.
    pub(crate) fn run<T, F>(&self, work: F) -> std::io::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> std::io::Result<T> + Send + 'static,
    {
        let file = self.file.clone();
        std::thread::spawn(move || {
            setns(&*file, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
            work()
        })
        .join()
        .map_err(|_| std::io::Error::other("network namespace worker panicked"))?
    }
}

/// Brings the current network namespace's loopback device up with one
/// RTM_NEWLINK (set IFF_UP on `lo`), as `ip link set lo up` would, from the
/// calling thread: a netlink socket acts in the namespace it was opened in,
/// so call this inside [`NetnsHandle::run`] (the image ships no `ip`).
pub(crate) fn set_loopback_up() -> std::io::Result<()> {
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
