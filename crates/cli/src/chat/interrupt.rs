//! Ctrl-C during a chat reply. While a [`ReplyGuard`] lives, SIGINT only sets a flag that the
//! reply loop polls, so the reply ends and the prompt comes back instead of the process dying;
//! dropping the guard restores the previous disposition, so Ctrl-C anywhere else (loading, or
//! a piped chat waiting for input) behaves as before.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the SIGINT handler, cleared when a guard is installed.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether Ctrl-C was pressed since the current guard was installed.
pub fn requested() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// SIGINT handled by setting [`INTERRUPTED`] for as long as this lives.
pub struct ReplyGuard {
    /// The disposition to restore; `None` when installing failed (Ctrl-C then kills as usual).
    #[cfg(unix)]
    previous: Option<libc::sigaction>,
}

#[cfg(unix)]
extern "C" fn on_sigint(_: libc::c_int) {
    // An atomic store is async-signal-safe; nothing else happens in the handler.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

impl ReplyGuard {
    #[cfg(unix)]
    pub fn install() -> ReplyGuard {
        INTERRUPTED.store(false, Ordering::SeqCst);
        // SAFETY: both sigaction structs are fully initialised (zeroed, then the handler and an
        // empty mask set) and the handler only touches an atomic.
        let previous = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            (libc::sigaction(libc::SIGINT, &action, &mut previous) == 0).then_some(previous)
        };
        ReplyGuard { previous }
    }

    /// Elsewhere Ctrl-C keeps its default effect; replies end at --max-tokens or end-of-sequence.
    #[cfg(not(unix))]
    pub fn install() -> ReplyGuard {
        INTERRUPTED.store(false, Ordering::SeqCst);
        ReplyGuard {}
    }
}

impl Drop for ReplyGuard {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(previous) = &self.previous {
            // SAFETY: restores the disposition sigaction returned at install.
            unsafe {
                libc::sigaction(libc::SIGINT, previous, std::ptr::null_mut());
            }
        }
    }
}
