//! What the forked child does to itself between `fork` and `exec` of
//! bubblewrap. `pre_exec` is unsafe because the closure runs in a child of a
//! multi-threaded process: it may only make async-signal-safe calls. This
//! one makes a few system calls and allocates nothing, so this module is, with
//! `tap.rs`, one of the two places in the host that allow `unsafe`.
#![allow(unsafe_code)]

use nix::sys::resource::{Resource, setrlimit};
use std::os::unix::process::CommandExt;

/// Resource limits of every confined program (and so of bubblewrap, which
/// needs a few processes and descriptors of its own).
pub(crate) const LIMITS: [(Resource, u64); 3] = [
    // Per user: with a user per provider, this bounds one provider's process table.
    (Resource::RLIMIT_NPROC, 512),
    (Resource::RLIMIT_NOFILE, 1024),
    (Resource::RLIMIT_CORE, 0),
];

const CLOSE_RANGE_CLOEXEC: nix::libc::c_uint = 1 << 2;

/// What the child does to itself besides the fixed steps.
#[derive(Debug, Default)]
pub(crate) struct BeforeExec {
    /// Descriptors bubblewrap is handed (binds, its info pipe): kept open on exec.
    pub keep: Vec<i32>,
    /// `cgroup.procs` descriptors to write `0` to: the child joins those groups.
    pub join: Vec<i32>,
    /// `RLIMIT_AS` where no group bounds the memory (bytes; 0: none).
    pub(crate) address_space: u64,
    /// Taps to attach to, as the provider's user, in the host's network
    /// namespace, each left open at its descriptor number for the program.
    pub taps: Vec<(crate::network::tap::TunRequest, i32)>,
}

/// In the child, before bubblewrap runs (std has already switched to the
/// sandbox user): its groups joined (a bound it cannot leave), first to die
/// when memory runs out (`oom_score_adj` 1000), a session of its own (no
/// controlling terminal to inject keystrokes into, and one process group the
/// host can signal whole), the limits, `no_new_privs`, and every descriptor
/// but 0-2 and `keep` closed on exec.
pub(crate) fn confine_before_exec(command: &mut std::process::Command, before: BeforeExec) {
    // SAFETY: the closure makes only async-signal-safe system calls (write,
    // open, close, setsid, setrlimit, prctl, close_range, fcntl) on values it
    // owns, and does not allocate (`before` was made before the fork).
    unsafe {
        command.pre_exec(move || {
            for &fd in &before.join {
                if nix::libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            let oom = nix::libc::open(c"/proc/self/oom_score_adj".as_ptr(), nix::libc::O_WRONLY | nix::libc::O_CLOEXEC);
            if oom >= 0 {
                nix::libc::write(oom, b"1000".as_ptr().cast(), 4);
                nix::libc::close(oom);
            }
            if before.address_space > 0 {
                setrlimit(Resource::RLIMIT_AS, before.address_space, before.address_space)?;
            }
            nix::unistd::setsid()?;
            for (resource, limit) in LIMITS {
                setrlimit(resource, limit, limit)?;
            }
            nix::sys::prctl::set_no_new_privs()?;
            let rc = nix::libc::syscall(nix::libc::SYS_close_range, 3, u32::MAX, CLOSE_RANGE_CLOEXEC);
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            for &fd in &before.keep {
                if nix::libc::fcntl(fd, nix::libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Already the provider's user, still in the host's network namespace:
            // the kernel attaches only to taps that user owns.
            for (request, at) in &before.taps {
                let tun = nix::libc::open(c"/dev/net/tun".as_ptr(), nix::libc::O_RDWR | nix::libc::O_CLOEXEC);
                if tun < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let mut request = *request;
                if nix::libc::ioctl(tun, crate::network::tap::TUNSETIFF, &mut request as *mut _) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if tun == *at {
                    // Opened at its very place (the lowest free descriptor):
                    // dup2 would do nothing, and closing it would close it.
                    if nix::libc::fcntl(tun, nix::libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    continue;
                }
                // dup2 leaves the new descriptor open across exec.
                if nix::libc::dup2(tun, *at) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                nix::libc::close(tun);
            }
            Ok(())
        });
    }
}
