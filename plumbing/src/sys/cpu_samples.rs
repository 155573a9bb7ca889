//! The CPU sampler behind `/debug/pprof/profile` (`--enable-profiling`):
//! while sampling runs, `setitimer(ITIMER_PROF)` sends the process SIGPROF
//! for every 10 ms of CPU time it uses (100 Hz, Go's rate), and the handler
//! writes the interrupted thread's stack into a fixed ring of slots that
//! the profiler drains as it goes.
//!
//! Why not a crate: pprof-rs, the usual one, preallocates a sample table
//! that left a test program 170 MiB resident after one profile (2 MiB
//! before) and keeps it for the life of the process. The ring here is
//! 512 slots of 64 frames (about 270 KiB, in `.bss`: untouched, and so not
//! resident, until the first profile), however long or wide the profile.
//!
//! What the handler may do is what is safe in a signal handler: atomics, a
//! `prctl` for the thread's name, and the unwinder. glibc 2.35 and libgcc
//! 12 (Debian bookworm, the image's base) find unwind tables with
//! `_dl_find_object`, which takes no lock; older ones take the loader's
//! lock in `dl_iterate_phdr`, and a sample landing inside `dlopen` could
//! then wait forever. The binaries never load libraries after start.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};

use nix::libc;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

/// Frames kept per sample, innermost first; deeper stacks lose their
/// outermost frames (Go keeps 64 too).
pub const MAX_FRAMES: usize = 64;
/// Samples per second of CPU time.
pub const SAMPLE_HZ: u32 = 100;
/// Ring slots. The profiler drains every 25 ms; at 100 Hz per busy core a
/// slot is reused only after 512 samples, so 200 cores would fit.
const SLOTS: usize = 512;
/// A thread's name as the kernel keeps it (`comm`), with its NUL.
pub const THREAD_NAME: usize = 16;

const EMPTY: u8 = 0;
const WRITING: u8 = 1;
const FULL: u8 = 2;

struct Slot {
    state: AtomicU8,
    depth: AtomicUsize,
    thread: [AtomicU8; THREAD_NAME],
    frames: [AtomicUsize; MAX_FRAMES],
}

static RING: [Slot; SLOTS] = [const {
    Slot {
        state: AtomicU8::new(EMPTY),
        depth: AtomicUsize::new(0),
        thread: [const { AtomicU8::new(0) }; THREAD_NAME],
        frames: [const { AtomicUsize::new(0) }; MAX_FRAMES],
    }
}; SLOTS];
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);
/// Whether the handler records (it stays installed between profiles).
static RECORDING: AtomicBool = AtomicBool::new(false);
/// Whether a [`CpuSampling`] exists: one profile at a time, as in Go.
static IN_USE: AtomicBool = AtomicBool::new(false);
/// Samples dropped because their slot was not drained yet.
static LOST: AtomicU64 = AtomicU64::new(0);
/// Whether the handler is installed (tried once).
static HANDLER: OnceLock<nix::Result<()>> = OnceLock::new();

/// Why sampling could not start.
#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("cpu profiling already in use")]
    InUse,
    #[error("installing the SIGPROF handler: {0}")]
    Handler(nix::Error),
    #[error("starting the profiling timer (setitimer): {0}")]
    Timer(std::io::Error),
}

/// Sampling in progress; dropping it stops the timer.
pub struct CpuSampling(());

/// One recorded sample: the interrupted thread's name and its stack, the
/// interrupted instruction first, then return addresses outwards.
pub struct Sample<'a> {
    pub thread: &'a [u8],
    pub frames: &'a [usize],
}

impl CpuSampling {
    pub fn start() -> Result<CpuSampling, SamplingError> {
        if IN_USE.swap(true, Ordering::AcqRel) {
            return Err(SamplingError::InUse);
        }
        let sampling = CpuSampling(());
        // Installed once, and never armed without it: SIGPROF's default
        // action ends the process.
        HANDLER
            .get_or_init(install_handler)
            .map_err(SamplingError::Handler)?;
        // Whatever a previous profile left unread is not this one's.
        for slot in &RING {
            if slot.state.load(Ordering::Acquire) == FULL {
                slot.state.store(EMPTY, Ordering::Release);
            }
        }
        LOST.store(0, Ordering::Relaxed);
        RECORDING.store(true, Ordering::Release);
        set_profiling_timer(std::time::Duration::from_micros(1_000_000 / SAMPLE_HZ as u64))
            .map_err(SamplingError::Timer)?;
        Ok(sampling)
    }

    /// Hands every sample recorded since the last call to `each` and frees
    /// its slot.
    pub fn drain(&self, mut each: impl FnMut(Sample<'_>)) {
        let mut frames = [0usize; MAX_FRAMES];
        let mut thread = [0u8; THREAD_NAME];
        for slot in &RING {
            if slot.state.load(Ordering::Acquire) != FULL {
                continue;
            }
            let depth = slot.depth.load(Ordering::Relaxed).min(MAX_FRAMES);
            for (copy, frame) in frames.iter_mut().zip(&slot.frames[..depth]) {
                *copy = frame.load(Ordering::Relaxed);
            }
            for (copy, byte) in thread.iter_mut().zip(&slot.thread) {
                *copy = byte.load(Ordering::Relaxed);
            }
            slot.state.store(EMPTY, Ordering::Release);
            let name_length = thread.iter().position(|&byte| byte == 0).unwrap_or(THREAD_NAME);
            each(Sample {
                thread: &thread[..name_length],
                frames: &frames[..depth],
            });
        }
    }

    /// Stops the timer and the recording; what is in the ring stays for a
    /// last [`drain`](Self::drain).
    pub fn stop(&self) {
        // A zero interval disarms the timer; it cannot fail for ITIMER_PROF.
        let _ = set_profiling_timer(std::time::Duration::ZERO);
        RECORDING.store(false, Ordering::Release);
    }

    /// Samples dropped since the start because the ring was full.
    pub fn lost(&self) -> u64 {
        LOST.load(Ordering::Relaxed)
    }
}

impl Drop for CpuSampling {
    fn drop(&mut self) {
        self.stop();
        IN_USE.store(false, Ordering::Release);
    }
}

fn install_handler() -> nix::Result<()> {
    let action = SigAction::new(
        SigHandler::SigAction(on_sigprof),
        // SA_RESTART: a blocking call the signal interrupts is resumed, not
        // failed with EINTR.
        SaFlags::SA_SIGINFO | SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: `on_sigprof` does only what is async-signal-safe (module
    // comment): atomics, prctl, the unwinder; it allocates nothing and
    // saves and restores errno. The handler is installed once and never
    // removed, so no SIGPROF can find the default action (which ends the
    // process) while a profile runs or after.
    unsafe { sigaction(Signal::SIGPROF, &action) }.map(|_| ())
}

fn set_profiling_timer(interval: std::time::Duration) -> std::io::Result<()> {
    let every = libc::timeval {
        tv_sec: interval.as_secs() as libc::time_t,
        tv_usec: interval.subsec_micros() as libc::suseconds_t,
    };
    let timer = libc::itimerval {
        it_interval: every,
        it_value: every,
    };
    // SAFETY: `timer` is a valid itimerval for the call's duration and the
    // old value is not asked for (null is allowed).
    let result = unsafe { libc::setitimer(libc::ITIMER_PROF, &timer, std::ptr::null_mut()) };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

extern "C" fn on_sigprof(_signal: libc::c_int, _info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    if !RECORDING.load(Ordering::Acquire) {
        return;
    }
    let errno = nix::errno::Errno::last_raw();
    let slot = &RING[NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS];
    if slot
        .state
        .compare_exchange(EMPTY, WRITING, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        LOST.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let interrupted = interrupted_instruction(context);
    slot.frames[0].store(interrupted, Ordering::Relaxed);
    let mut depth = usize::from(interrupted != 0);
    // The unwinder starts in this handler; what was interrupted starts at
    // the frame whose address is the interrupted instruction.
    let mut past_handler = interrupted == 0;
    // SAFETY: the unwinder reads only the stack and the unwind tables, as
    // the module comment says; the closure touches only atomics and locals
    // and never unwinds. Unsynchronized is what a signal handler needs:
    // the synchronized version takes a lock the interrupted code may hold.
    unsafe {
        backtrace::trace_unsynchronized(|frame| {
            let address = frame.ip() as usize;
            if !past_handler {
                past_handler = address == interrupted;
                return true;
            }
            if depth == MAX_FRAMES || address == 0 {
                return false;
            }
            slot.frames[depth].store(address, Ordering::Relaxed);
            depth += 1;
            true
        });
    }
    let mut name = [0u8; THREAD_NAME];
    // SAFETY: PR_GET_NAME writes at most 16 bytes, NUL included, into the
    // buffer, which has 16.
    if unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) } != 0 {
        name = [0; THREAD_NAME];
    }
    for (byte, stored) in name.iter().zip(&slot.thread) {
        stored.store(*byte, Ordering::Relaxed);
    }
    slot.depth.store(depth, Ordering::Relaxed);
    slot.state.store(FULL, Ordering::Release);
    nix::errno::Errno::set_raw(errno);
}

/// The instruction the signal interrupted, from the saved context.
fn interrupted_instruction(context: *mut libc::c_void) -> usize {
    let context = context as *const libc::ucontext_t;
    if context.is_null() {
        return 0;
    }
    // SAFETY: with SA_SIGINFO the kernel passes a valid ucontext_t that
    // lives for the handler's duration; only a register is read.
    #[cfg(target_arch = "x86_64")]
    let address = unsafe { (*context).uc_mcontext.gregs[libc::REG_RIP as usize] as usize };
    // SAFETY: as above.
    #[cfg(target_arch = "aarch64")]
    let address = unsafe { (*context).uc_mcontext.pc as usize };
    // Elsewhere the unwinder's frames are kept from the handler on.
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let address = 0;
    address
}
