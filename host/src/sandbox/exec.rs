//! What the forked child does to itself between `fork` and `exec` of
//! bubblewrap. `pre_exec` is unsafe because the closure runs in a child of a
//! multi-threaded process: it may only make async-signal-safe calls. This
//! one makes four system calls and allocates nothing, so this module is, with
//! `tap.rs`, one of the two places in the host that allow `unsafe`.
#![allow(unsafe_code)]

use nix::sys::resource::{Resource, setrlimit};
use std::os::unix::process::CommandExt;

/// Resource limits of every confined program (and so of bubblewrap, which
/// needs a few processes and descriptors of its own).
pub const LIMITS: [(Resource, u64); 3] = [
    // Per user: with a user per provider, this bounds one provider's process table.
    (Resource::RLIMIT_NPROC, 512),
    (Resource::RLIMIT_NOFILE, 1024),
    (Resource::RLIMIT_CORE, 0),
];

const CLOSE_RANGE_CLOEXEC: nix::libc::c_uint = 1 << 2;

/// In the child, before bubblewrap runs (std has already switched to the
/// sandbox user): a session of its own (no controlling terminal to inject
/// keystrokes into, and one process group the host can signal whole), the
/// limits, `no_new_privs`, and every descriptor but 0-2 closed on exec.
pub fn confine_before_exec(command: &mut std::process::Command) {
    // SAFETY: the closure makes only async-signal-safe system calls (setsid,
    // setrlimit, prctl, close_range) on values it owns, and does not allocate.
    unsafe {
        command.pre_exec(|| {
            nix::unistd::setsid()?;
            for (resource, limit) in LIMITS {
                setrlimit(resource, limit, limit)?;
            }
            nix::sys::prctl::set_no_new_privs()?;
            let rc = nix::libc::syscall(nix::libc::SYS_close_range, 3, u32::MAX, CLOSE_RANGE_CLOEXEC);
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
