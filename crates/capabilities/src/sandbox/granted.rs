//! Host paths a manifest grants, as the host acts on them: each resolved
//! once, from `/`, with `openat2(RESOLVE_NO_SYMLINKS)` — a link in any
//! component is refused, never followed — and from then on acted on only
//! through that descriptor: its ACLs are set on it and bubblewrap binds it
//! (`--bind-fd`), so a provider that can write a directory above a grant
//! cannot swap the grant for a link between the host's check and its use.
//!
//! Where a grant may lie is checked when a provider is loaded
//! ([`check_placement`]): never under or above the host's data dir (every
//! provider's data dir and state), never below another provider's
//! `paths-rw` (that provider could replace it), and a `paths-rw` never above
//! another provider's grant.

use super::SandboxError;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

/// A host path opened once for binding, with what the sandbox may do there.
#[derive(Debug)]
pub struct Bound {
    /// `O_PATH` descriptor of the object itself.
    pub(crate) fd: OwnedFd,
    /// Where it is bound in the sandbox (its own host path).
    pub(crate) at: PathBuf,
    /// Bound read-write.
    pub(crate) writable: bool,
}

impl Bound {
    pub(crate) fn raw(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

/// Open `path` (absolute) without following a link in any component: an
/// `O_PATH` descriptor, or `None` when the host lacks it.
pub(crate) fn open_unlinked(path: &Path) -> Result<Option<OwnedFd>, SandboxError> {
    if !is_plain_absolute(path) {
        return Err(SandboxError::GrantedPath {
            path: path.display().to_string(),
            reason: "it must be absolute, without `.` or `..`".into(),
        });
    }
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .mode(Mode::empty())
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match nix::fcntl::openat2(nix::fcntl::AT_FDCWD, path, how) {
        Ok(fd) => Ok(Some(fd)),
        Err(nix::errno::Errno::ENOENT) => Ok(None),
        Err(nix::errno::Errno::ELOOP) => Err(SandboxError::GrantedPath {
            path: path.display().to_string(),
            reason: "a component of it is a symbolic link, which the host never follows in a granted path \
                     (grant the link's target instead)"
                .into(),
        }),
        Err(errno) => Err(SandboxError::GrantedPath { path: path.display().to_string(), reason: errno.to_string() }),
    }
}

/// Absolute, and no `.`, `..` or doubled separator that `Path` would hide.
fn is_plain_absolute(path: &Path) -> bool {
    let Some(text) = path.to_str() else { return false };
    text.starts_with('/')
        && !text.contains("//")
        && path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && text.split('/').skip(1).all(|part| part != "." && part != ".." && !(part.is_empty() && text != "/"))
}

/// What one provider is granted, as far as where it lies matters.
#[derive(Debug, Clone, Default)]
pub struct GrantedPaths {
    /// The provider.
    pub provider: String,
    /// Paths its programs read (`paths`, and the programs themselves).
    pub read: Vec<PathBuf>,
    /// Paths its programs write (`paths-rw`).
    pub write: Vec<PathBuf>,
}

/// Refuse a provider's grants that another party could hand it through a link:
/// under or above `data_dir` (the host's: every data dir and the state),
/// strictly below another provider's `paths-rw`, or (for its own `paths-rw`)
/// strictly above another provider's grant. The same path granted to two
/// providers is allowed: neither can replace it, only what is in it.
pub fn check_placement(new: &GrantedPaths, others: &[GrantedPaths], data_dir: &Path) -> Result<(), SandboxError> {
    let refuse = |path: &Path, reason: String| SandboxError::GrantedPath { path: path.display().to_string(), reason };
    let claims = std::path::PathBuf::from(super::claims::DEFAULT_CLAIMS_DIR);
    let reserved: [(&Path, &str); 4] = [
        (data_dir, "the host's data dir (every provider's data dir and the host's state)"),
        (Path::new(super::scratch::RUN), "where the host mounts every provider's /tmp"),
        (&claims, "the machine's sandbox uid claims"),
        (Path::new("/sys/fs/cgroup"), "the cgroup hierarchies the host bounds programs with"),
    ];
    for path in new.read.iter().chain(&new.write) {
        if let Some((root, what)) = reserved.iter().find(|(root, _)| path.starts_with(root) || root.starts_with(path)) {
            return Err(refuse(
                path,
                format!("it {} {} {what}", if path.starts_with(root) { "lies in" } else { "holds" }, root.display()),
            ));
        }
        for other in others.iter().filter(|o| o.provider != new.provider) {
            if let Some(above) = other.write.iter().find(|w| path.starts_with(w) && path != *w) {
                return Err(refuse(
                    path,
                    format!(
                        "it lies in {}, which provider {:?} may write (`paths-rw`): it could replace it with a link",
                        above.display(),
                        other.provider
                    ),
                ));
            }
        }
    }
    for path in &new.write {
        for other in others.iter().filter(|o| o.provider != new.provider) {
            if let Some(below) = other.read.iter().chain(&other.write).find(|g| g.starts_with(path) && path != *g) {
                return Err(refuse(
                    path,
                    format!(
                        "provider {:?} is granted {} inside it: with `paths-rw` here this provider could replace that with a link",
                        other.provider,
                        below.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The binds of one provider's sandbox in the order bubblewrap must make
/// them: shallower first, so a grant nested in another is mounted on top of
/// it, and at one depth read-write before read-only, so the stricter mode of
/// a path granted both ways wins.
pub(crate) fn bind_order(binds: &mut [Bound]) {
    binds.sort_by_key(|b| (b.at.components().count(), !b.writable));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(provider: &str, read: &[&str], write: &[&str]) -> GrantedPaths {
        GrantedPaths {
            provider: provider.into(),
            read: read.iter().map(PathBuf::from).collect(),
            write: write.iter().map(PathBuf::from).collect(),
        }
    }

    #[test]
    fn a_grant_another_provider_can_replace_or_that_reaches_the_hosts_state_is_refused() {
        let data = Path::new("/var/lib/broker");
        let a = granted("a", &[], &["/srv/shared"]);
        let others = [a.clone()];
        let check = |g: &GrantedPaths| check_placement(g, &others, data).map_err(|e| e.to_string());
        let err = check(&granted("b", &["/srv/shared/images"], &[])).unwrap_err();
        assert!(err.contains("provider \"a\"") && err.contains("/srv/shared/images"), "{err}");
        assert!(check(&granted("b", &[], &["/srv/shared/x/y"])).is_err());
        let err = check(&granted("b", &[], &["/srv"])).unwrap_err();
        assert!(err.contains("inside it"), "{err}");
        assert!(check(&granted("b", &["/srv/shared"], &[])).is_ok(), "the same path is no link anyone can plant");
        assert!(check(&granted("b", &["/srv/sharedx"], &["/srv/other"])).is_ok(), "by components, not bytes");
        assert!(check(&granted("a", &["/srv/shared/images"], &[])).is_ok(), "its own paths-rw");
        for bad in ["/var/lib/broker/data/a", "/var/lib/broker", "/var/lib", "/"] {
            let err = check(&granted("b", &[bad], &[])).unwrap_err();
            assert!(err.contains("data dir"), "{bad}: {err}");
        }
        for bad in ["/run", "/run/wasm-broker/2000000000", "/var/lib/wasm-broker/uids", "/sys/fs/cgroup/memory"] {
            let err = check(&granted("b", &[], &[bad])).unwrap_err();
            assert!(err.contains("the host") || err.contains("the machine"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_link_in_any_component_of_a_grant_is_refused_and_a_missing_one_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir_all(real.join("images")).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", real.join("images/secret")).unwrap();
        assert!(open_unlinked(&real.join("images")).unwrap().is_some());
        for linked in [dir.path().join("link/images"), real.join("images/secret")] {
            let err = open_unlinked(&linked).unwrap_err().to_string();
            assert!(err.contains("symbolic link"), "{err}");
        }
        assert!(open_unlinked(&real.join("absent")).unwrap().is_none());
        for bad in ["relative", "/a/../b", "/a/./b", "/a//b"] {
            assert!(open_unlinked(Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn nested_grants_keep_the_stricter_mode() {
        let fd = || open_unlinked(Path::new("/")).unwrap().unwrap();
        let bound = |at: &str, writable| Bound { fd: fd(), at: at.into(), writable };
        let mut binds = vec![
            bound("/srv/rw/ro", false),
            bound("/srv/rw", true),
            bound("/srv/both", false),
            bound("/srv/both", true),
        ];
        bind_order(&mut binds);
        let order: Vec<(String, bool)> = binds.iter().map(|b| (b.at.display().to_string(), b.writable)).collect();
        assert_eq!(
            order,
            [
                ("/srv/rw".into(), true),
                ("/srv/both".into(), true),
                ("/srv/both".into(), false),
                ("/srv/rw/ro".into(), false)
            ]
        );
    }
}
