//! The one tmpfs a provider's programs share as `/tmp` and `/dev/shm`: sized
//! (`[limits] tmp-mib`), `noexec`, `nosuid`, `nodev`, mounted by the host at
//! `/run/wasm-broker/<key>` (the provider's uid, which is the machine's, so no
//! two providers of any two hosts share one; the uid and the provider's name
//! where providers share a user) and bound into each sandbox by descriptor. The
//! mount's flags are locked once bubblewrap's user namespace holds it: a
//! program cannot remount it executable. Its pages are charged to the
//! program that wrote them, so they count against its group's memory too.

use rustix::fs::{Mode, OFlags};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

pub(crate) const RUN: &str = "/run/wasm-broker";

/// Where scratch tmpfs `key` is mounted.
pub(crate) fn mount_point(key: &str) -> PathBuf {
    Path::new(RUN).join(key)
}

fn is_mount_point(dir: &Path) -> std::io::Result<bool> {
    let here = rustix::fs::stat(dir)?;
    let parent = rustix::fs::stat(dir.parent().unwrap_or(Path::new("/")))?;
    Ok(here.st_dev != parent.st_dev)
}

/// Mount (or resize) scratch tmpfs `key`, owned by `uid`: `mib` MiB and as
/// many inodes as 4 KiB files would fill. Returns an `O_PATH` descriptor of its root.
pub fn prepare(key: &str, uid: u32, mib: u64) -> std::io::Result<OwnedFd> {
    // Searchable, not listable: bubblewrap, as the provider's user, reaches its own mount by descriptor
    // (the kernel still wants the way to it searchable); each mount is 0700, its user's.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o711).create(RUN)?;
    std::fs::set_permissions(RUN, std::os::unix::fs::PermissionsExt::from_mode(0o711))?;
    let dir = mount_point(key);
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let inodes = (mib.saturating_mul(256)).max(1024);
    let options = format!("size={mib}m,nr_inodes={inodes},mode=0700,uid={uid},gid={uid}");
    use nix::mount::MsFlags;
    let flags = MsFlags::MS_NOEXEC | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if is_mount_point(&dir)? {
        // Left by an earlier host (children outlive it) or this one: resized to what is granted now.
        nix::mount::mount(None::<&str>, &dir, None::<&str>, flags | MsFlags::MS_REMOUNT, Some(options.as_str()))?;
    } else {
        nix::mount::mount(Some("tmpfs"), &dir, Some("tmpfs"), flags, Some(options.as_str()))?;
    }
    Ok(rustix::fs::open(&dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?)
}

/// Unmount and remove scratch tmpfs `key` (its provider is removed).
pub fn remove(key: &str) {
    let dir = mount_point(key);
    if is_mount_point(&dir).unwrap_or(false)
        && let Err(error) = nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH)
    {
        tracing::warn!(dir = %dir.display(), %error, "cannot unmount a removed provider's /tmp");
        return;
    }
    let _ = std::fs::remove_dir(&dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_tmpfs_is_sized_noexec_and_resized_in_place() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: mounting needs root");
            return;
        }
        let uid = 3_900_200_000 + std::process::id() % 1000;
        let key = uid.to_string();
        let root = prepare(&key, uid, 2).unwrap();
        drop(root);
        let dir = mount_point(&key);
        let stat = nix::sys::statvfs::statvfs(&dir).unwrap();
        assert_eq!(stat.blocks() * stat.fragment_size(), 2 << 20);
        assert!(stat.flags().contains(nix::sys::statvfs::FsFlags::ST_NOEXEC));
        std::fs::write(dir.join("kept"), "x").unwrap();
        prepare(&key, uid, 4).unwrap();
        let stat = nix::sys::statvfs::statvfs(&dir).unwrap();
        assert_eq!(stat.blocks() * stat.fragment_size(), 4 << 20, "resized");
        assert!(dir.join("kept").exists(), "in place: what is there stays");
        let big = std::fs::write(dir.join("big"), vec![0u8; 5 << 20]);
        assert!(big.is_err(), "bounded");
        remove(&key);
        assert!(!dir.exists());
    }
}
