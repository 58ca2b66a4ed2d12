//! Opening files the host handles for a provider, beneath its data dir:
//! `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, so a link the guest
//! (or one of its programs) planted is refused rather than followed.

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use std::os::fd::OwnedFd;
use std::path::Path;

/// Why a file beneath a data dir was not opened.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    /// The path is a symlink or resolves outside the root (`ELOOP`, `EXDEV`).
    #[error("{path} is a link or leaves the data dir: the host follows no link a provider made")]
    Escapes {
        /// The path as the host names it.
        path: String,
    },
    /// Any other failure of the open.
    #[error("{path}: {}", crate::error_text::cause_text(.cause))]
    Io {
        /// The path as the host names it.
        path: String,
        /// The errno.
        cause: Errno,
    },
}

fn how(flags: OFlag, mode: Mode) -> OpenHow {
    OpenHow::new()
        // No O_NOFOLLOW: with O_PATH it would open a final link itself; RESOLVE_NO_SYMLINKS refuses it.
        .flags(flags | OFlag::O_CLOEXEC)
        .mode(mode)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS)
}

fn error(root: &Path, relative: &Path, errno: Errno) -> BeneathError {
    let path = root.join(relative).display().to_string();
    match errno {
        Errno::ELOOP | Errno::EXDEV => BeneathError::Escapes { path },
        source => BeneathError::Io { path, cause: source },
    }
}

/// The directory `relative` (one name) beneath `root`, made if missing.
pub fn dir(root: &Path, relative: &Path) -> Result<OwnedFd, BeneathError> {
    // mkdirat would follow links in a longer path: one name only.
    if relative.components().count() != 1
        || !matches!(relative.components().next(), Some(std::path::Component::Normal(_)))
    {
        return Err(BeneathError::Escapes { path: root.join(relative).display().to_string() });
    }
    let top = nix::fcntl::open(root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| error(root, Path::new(""), e))?;
    match nix::sys::stat::mkdirat(&top, relative, Mode::from_bits_truncate(0o755)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(error(root, relative, e)),
    }
    nix::fcntl::openat2(&top, relative, how(OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty()))
        .map_err(|e| error(root, relative, e))
}

/// Open (creating) `name` in the directory `dir` for appending: a regular
/// file only, never through a link.
pub fn append(dir: &OwnedFd, shown_as: &Path, name: &str) -> Result<std::fs::File, BeneathError> {
    let flags = OFlag::O_WRONLY | OFlag::O_APPEND | OFlag::O_CREAT | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    let fd = nix::fcntl::openat2(dir, name, how(flags, Mode::from_bits_truncate(0o644)))
        .map_err(|e| error(shown_as, Path::new(name), e))?;
    let stat = nix::sys::stat::fstat(&fd).map_err(|e| error(shown_as, Path::new(name), e))?;
    if stat.st_mode & nix::libc::S_IFMT != nix::libc::S_IFREG {
        return Err(BeneathError::Io { path: shown_as.join(name).display().to_string(), cause: Errno::EINVAL });
    }
    Ok(std::fs::File::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_link_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "untouched").unwrap();
        let logs = super::dir(&data, Path::new("logs")).unwrap();
        std::os::unix::fs::symlink(&victim, data.join("logs/x.log")).unwrap();
        assert!(matches!(append(&logs, &data.join("logs"), "x.log"), Err(BeneathError::Escapes { .. })));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
        // A link in place of the directory itself is refused too.
        std::os::unix::fs::symlink(dir.path(), data.join("up")).unwrap();
        assert!(matches!(super::dir(&data, Path::new("up")), Err(BeneathError::Escapes { .. })));
        let mut log = append(&logs, &data.join("logs"), "y.log").unwrap();
        std::io::Write::write_all(&mut log, b"ok").unwrap();
        assert_eq!(std::fs::read_to_string(data.join("logs/y.log")).unwrap(), "ok");
    }
}
