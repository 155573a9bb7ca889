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
