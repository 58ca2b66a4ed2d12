//! A control group per provider for all its programs: a memory bound (their
//! tmpfs pages included, as the kernel charges them to whoever touched them)
//! and a pids bound, so a program that hits its bound is killed, never the
//! daemon, and the programs' memory is charged to their group, not the
//! daemon's (a daemon under systemd's `MemoryMax` no longer pays for them).
//!
//! The group is named after the provider's uid, which is the machine's (see
//! [`super::claims`]), or after the uid and the provider's name where
//! providers share one user (`[sandbox] user`), so each keeps bounds of its
//! own: `wasm-broker/<key>` under cgroup v2's one hierarchy, or
//! under v1's `memory` and `pids` hierarchies. A program joins it between
//! `fork` and `exec` by writing `0` to `cgroup.procs` through a descriptor
//! the host opened, so nothing it runs escapes the bound, not even
//! bubblewrap's first process. Where neither hierarchy can be written (no
//! root, no cgroupfs), programs get `RLIMIT_AS` instead and the README says so.

use rustix::fs::{Mode, OFlags};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";
const GROUP: &str = "wasm-broker";

/// Which cgroup hierarchy the machine has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hierarchy {
    /// The unified hierarchy (`cgroup.controllers` at the root).
    V2,
    /// Separate `memory` and `pids` hierarchies.
    V1,
}

/// The machine's hierarchy, if the host can make groups in it.
pub(crate) fn hierarchy() -> Option<Hierarchy> {
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    if Path::new(ROOT).join("cgroup.controllers").exists() {
        Some(Hierarchy::V2)
    } else if Path::new(ROOT).join("memory/cgroup.procs").exists() && Path::new(ROOT).join("pids/cgroup.procs").exists()
    {
        Some(Hierarchy::V1)
    } else {
        None
    }
}

/// One provider's group, made and bounded; what a program needs to join it.
#[derive(Debug)]
pub(crate) struct ProviderGroup {
    /// `cgroup.procs` of each, open for writing.
    procs: Vec<OwnedFd>,
}

fn write_file(dir: &Path, name: &str, value: &str) -> std::io::Result<()> {
    std::fs::write(dir.join(name), value)
}

impl ProviderGroup {
    /// Make (or find) the group `key` of one provider (see [`super::Sandbox::bounds_key`])
    /// and set its bounds: `memory_mib` of memory, `pids` processes and threads.
    pub(crate) fn new(hierarchy: Hierarchy, key: &str, memory_mib: u64, pids: u64) -> std::io::Result<ProviderGroup> {
        let memory = memory_mib.saturating_mul(1 << 20).to_string();
        let dirs = match hierarchy {
            Hierarchy::V2 => {
                let parent = Path::new(ROOT).join(GROUP);
                std::fs::create_dir_all(&parent)?;
                // The controllers must be handed down to the group's children.
                for dir in [Path::new(ROOT), parent.as_path()] {
                    write_file(dir, "cgroup.subtree_control", "+memory +pids")?;
                }
                let dir = parent.join(key);
                std::fs::create_dir_all(&dir)?;
                write_file(&dir, "memory.max", &memory)?;
                // No swap to spill into: the bound is the bound.
                let _ = write_file(&dir, "memory.swap.max", "0");
                write_file(&dir, "pids.max", &pids.to_string())?;
                vec![dir]
            }
            Hierarchy::V1 => {
                let memory_dir = Path::new(ROOT).join("memory").join(GROUP).join(key);
                std::fs::create_dir_all(&memory_dir)?;
                // memsw (memory + swap, where swap is accounted) may never be below the memory
                // bound: lifted first, so a raised bound is not refused, then set to it.
                let _ = write_file(&memory_dir, "memory.memsw.limit_in_bytes", "-1");
                write_file(&memory_dir, "memory.limit_in_bytes", &memory)?;
                let _ = write_file(&memory_dir, "memory.memsw.limit_in_bytes", &memory);
                let pids_dir = Path::new(ROOT).join("pids").join(GROUP).join(key);
                std::fs::create_dir_all(&pids_dir)?;
                write_file(&pids_dir, "pids.max", &pids.to_string())?;
                vec![memory_dir, pids_dir]
            }
        };
        let mut procs = Vec::new();
        for dir in &dirs {
            let flags = OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
            procs.push(rustix::fs::open(dir.join("cgroup.procs"), flags, Mode::empty())?);
        }
        Ok(ProviderGroup { procs })
    }

    /// The descriptors a program writes `0` to, to join the group.
    pub(crate) fn join_fds(&self) -> Vec<i32> {
        self.procs.iter().map(|fd| fd.as_raw_fd()).collect()
    }
}

fn pids_in(dirs: &[PathBuf]) -> Vec<u32> {
    let mut pids: Vec<u32> = dirs
        .iter()
        .filter_map(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
        .flat_map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect::<Vec<u32>>())
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn kill_all_in(dirs: &[PathBuf]) -> usize {
    // v2 kills the whole group at once; otherwise signal until it is empty
    // (a fork between the reading and the signal is caught on the next round).
    if let Some(dir) = dirs.first().filter(|d| d.join("cgroup.kill").exists()) {
        let count = pids_in(dirs).len();
        let _ = write_file(dir, "cgroup.kill", "1");
        return count;
    }
    let mut killed = std::collections::HashSet::new();
    for _ in 0..100 {
        let pids = pids_in(dirs);
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
            killed.insert(pid);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    killed.len()
}

/// The dirs of group `key`, whether or not this process made them (a
/// provider removed after a restart).
pub(crate) fn dirs_of(key: &str) -> Vec<PathBuf> {
    match hierarchy() {
        Some(Hierarchy::V2) => vec![Path::new(ROOT).join(GROUP).join(key)],
        Some(Hierarchy::V1) => {
            ["memory", "pids"].iter().map(|controller| Path::new(ROOT).join(controller).join(GROUP).join(key)).collect()
        }
        None => Vec::new(),
    }
    .into_iter()
    .filter(|dir| dir.exists())
    .collect()
}

/// Kill everything in group `key` and remove the group (a provider being
/// removed); how many processes were killed.
pub fn remove(key: &str) -> usize {
    let dirs = dirs_of(key);
    let killed = kill_all_in(&dirs);
    for dir in &dirs {
        // An empty group is removed with rmdir; one still emptying is left for the next removal.
        for _ in 0..50 {
            match std::fs::remove_dir(dir) {
                Ok(()) => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::EBUSY) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(_) => break,
            }
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A program in the group cannot take more than the group's memory: the
    /// kernel kills it, and the test (its parent) lives on.
    #[test]
    fn a_program_past_its_groups_memory_is_killed_and_nothing_else() {
        let Some(hierarchy) = hierarchy() else {
            eprintln!("skipped: making cgroups needs root and a cgroupfs");
            return;
        };
        let key = (3_900_100_000 + std::process::id() % 1000).to_string();
        let group = ProviderGroup::new(hierarchy, &key, 32, 64).unwrap();
        let mut command = std::process::Command::new("/usr/bin/python3");
        command.args(["-c", "x = bytearray(256 << 20); print('survived')"]);
        super::super::exec::confine_before_exec(
            &mut command,
            super::super::exec::BeforeExec { join: group.join_fds(), ..Default::default() },
        );
        let out = command.output().unwrap();
        assert!(!String::from_utf8_lossy(&out.stdout).contains("survived"), "{out:?}");
        assert!(!out.status.success());
        assert!(pids_in(&dirs_of(&key)).is_empty());
        drop(group);
        // Raised and lowered again on the group as it stands (a manifest changed).
        drop(ProviderGroup::new(hierarchy, &key, 4096, 64).unwrap());
        drop(ProviderGroup::new(hierarchy, &key, 64, 64).unwrap());
        assert_eq!(remove(&key), 0);
        assert!(dirs_of(&key).is_empty(), "removed");
    }
}
