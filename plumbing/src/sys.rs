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

/// As [`collect_freed_memory`], and also gives back the free memory
/// mimalloc keeps cached for reuse: after a rare, large, short-lived use
/// (a profile's symbol tables, tens of MiB) that cache would otherwise stay
/// resident. Costs a pass over the process's segments: not for hot paths.
pub fn give_back_cached_memory() {
    // SAFETY: as in `collect_freed_memory`; `force` only makes mimalloc
    // also purge its caches, under its own locks.
    unsafe { libmimalloc_sys::mi_collect(true) }
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

/// The global allocator of both binaries: mimalloc, counting the bytes
/// allocated and not yet freed. Resident memory says how much the allocator
/// holds, which moves with its caches and with which pages it could give
/// back; the live count moves only with what the program holds, so a leak
/// shows there and nowhere else (`runtime_heap_bytes` in /metrics).
///
/// The count is split over cache-line-sized shards, one per thread (modulo
/// their number), so that workers allocating at once do not contend for
/// one counter.
pub struct CountingAllocator;

const HEAP_SHARDS: usize = 16;

#[repr(align(128))]
struct Shard(std::sync::atomic::AtomicIsize);

static HEAP_LIVE: [Shard; HEAP_SHARDS] =
    [const { Shard(std::sync::atomic::AtomicIsize::new(0)) }; HEAP_SHARDS];
static NEXT_SHARD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

std::thread_local! {
    // No destructor, so usable from the allocator at any point of a
    // thread's life, teardown included.
    static HEAP_SHARD: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

fn count_heap(delta: isize) {
    use std::sync::atomic::Ordering::Relaxed;
    let shard = HEAP_SHARD
        .try_with(|shard| {
            if shard.get() == usize::MAX {
                shard.set(NEXT_SHARD.fetch_add(1, Relaxed) % HEAP_SHARDS);
            }
            shard.get()
        })
        .unwrap_or(0);
    HEAP_LIVE[shard].0.fetch_add(delta, Relaxed);
}

/// Bytes allocated through [`CountingAllocator`] and not yet freed (0 in a
/// program that installs another allocator).
pub fn heap_bytes() -> i64 {
    HEAP_LIVE
        .iter()
        .map(|shard| shard.0.load(std::sync::atomic::Ordering::Relaxed) as i64)
        .sum()
}

// SAFETY: every method forwards its arguments unchanged to mimalloc's
// implementation of the same method, which upholds GlobalAlloc's contract;
// the counting around it allocates nothing and touches only atomics and a
// destructor-less thread-local.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's guarantees for `layout` are passed on.
        let pointer = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if !pointer.is_null() {
            count_heap(layout.size() as isize);
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let pointer = unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        if !pointer.is_null() {
            count_heap(layout.size() as isize);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `pointer` came from this allocator with `layout`, as the
        // caller guarantees; mimalloc allocated it.
        unsafe { mimalloc::MiMalloc.dealloc(pointer, layout) };
        count_heap(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc`, and `new_size` is valid as the caller
        // guarantees.
        let moved = unsafe { mimalloc::MiMalloc.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            count_heap(new_size as isize - layout.size() as isize);
        }
        moved
    }
}

pub mod cpu_samples;

/// Makes the child `command` starts die (SIGKILL) when the thread that
/// starts it exits: a harness killed before it could stop its children
/// (the benchmark's fleets hold thousands of connections) leaves none
/// behind. Start it from a thread that lives as long as the child should.
pub fn die_with_parent(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: it makes one prctl(2) call
    // (through nix, no allocation) and returns its error by value.
    unsafe {
        command.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
}
