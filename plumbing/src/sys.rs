//! The project's only unsafe code: calls into C that have no safe wrapper.
//! Each says why it is sound.
#![allow(unsafe_code)]

/// Sorts out the memory the calling thread's allocator heap has had freed
/// (by this thread or others) and returns whole free pages to the OS.
///
/// mimalloc, the allocator of both binaries, does this by itself only when
/// the owning thread allocates again; a runtime worker that goes idle after
/// a burst would otherwise keep the burst's memory resident until the next
/// one, which looks like a leak to anyone watching the process.
pub fn collect_freed_memory() {
    // SAFETY: `mi_collect` takes no pointers, touches only the calling
    // thread's own heap (and the process-wide arenas under mimalloc's own
    // locks), and mimalloc documents it as callable at any time. When the
    // process's allocator is not mimalloc, it finds an empty heap.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

/// The most descriptors one packet carries (the kernel's limit is 253).
pub const MAX_PASSED_FDS: usize = 8;

/// Sends one packet of a `SOCK_SEQPACKET` Unix socket with `fds` attached
/// (SCM_RIGHTS): the receiving process gets its own descriptors for the same
/// open sockets and files. No unsafe code: here beside its counterpart.
pub fn send_with_fds(
    socket: std::os::fd::BorrowedFd<'_>,
    message: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd;
    assert!(
        fds.len() <= MAX_PASSED_FDS,
        "at most {MAX_PASSED_FDS} descriptors a packet"
    );
    let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let control = if raw.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    let sent = sendmsg::<()>(
        socket.as_raw_fd(),
        &[std::io::IoSlice::new(message)],
        &control,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent != message.len() {
        return Err(std::io::Error::other("packet sent in part"));
    }
    Ok(())
}

/// Receives one packet of a `SOCK_SEQPACKET` Unix socket into `buffer`, and
/// the descriptors attached to it, owned by the caller: its length and the
/// descriptors. A packet whose descriptors did not all arrive (MSG_CTRUNC)
/// is an error, and those that did are closed.
pub fn recv_with_fds(
    socket: std::os::fd::BorrowedFd<'_>,
    buffer: &mut [u8],
) -> std::io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let mut control = nix::cmsg_space!([std::os::fd::RawFd; MAX_PASSED_FDS]);
    let mut iov = [std::io::IoSliceMut::new(buffer)];
    let received = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut control),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for message in received.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = message {
            for fd in raw {
                // SAFETY: the kernel has just installed `fd` in this
                // process's table for this packet (SCM_RIGHTS); nothing
                // else in the process knows of it, so it is ours to own
                // and to close, exactly once.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    let flags = received.flags;
    let length = received.bytes;
    if flags.contains(MsgFlags::MSG_CTRUNC) || flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(std::io::Error::other("packet or its descriptors cut short"));
    }
    Ok((length, fds))
}
