//! Sandbox uids are the machine's, not one host's: every broker host on a
//! machine claims the uids it gives its providers in one system directory
//! (`[sandbox] uid-claims`, default `/var/lib/wasm-broker/uids`), one file per
//! uid made with `O_EXCL`, so two hosts' providers never run as one user
//! (sharing its `RLIMIT_NPROC`, its ACL entries, its processes).
//!
//! A claim names the host (its data dir, with the dir's device and inode, so
//! a new data dir at an old path is another host) and the provider. A claim
//! whose host's data dir is gone and under whose uid no process runs is
//! stale: it may be taken again (the files such a user left elsewhere become
//! the new provider's, as they would after any uid reuse).

use rustix::fs::{FlockOperation, Mode, OFlags};
use serde::{Deserialize, Serialize};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// Where claims are kept unless `[sandbox] uid-claims` says otherwise.
pub(crate) const DEFAULT_CLAIMS_DIR: &str = "/var/lib/wasm-broker/uids";

/// A claim is a few hundred bytes; anything longer is not one of ours.
const MAX_CLAIM_BYTES: u64 = 8192;

/// What a claim file says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Claim {
    /// The claiming host's data dir.
    data_dir: String,
    /// Its device and inode when it claimed.
    dev: u64,
    ino: u64,
    /// The provider whose programs run as the uid.
    provider: String,
}

/// Why a uid could not be claimed or is another's.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClaimError {
    /// The uid is claimed by another host or provider on this machine.
    #[error(
        "uid {uid} is claimed on this machine by provider {provider:?} of the broker host at {data_dir} ({file}): two hosts' providers would run as one user. Give one host another `[sandbox] uid-base`, or remove the other host's provider"
    )]
    Taken {
        /// The uid.
        uid: u32,
        /// Who holds it.
        provider: String,
        /// The other host's data dir.
        data_dir: String,
        /// The claim file.
        file: String,
    },
    /// The claims directory or a claim could not be read or written.
    #[error("uid claims in {dir}: {}", crate::error_text::cause_text(.cause))]
    Io {
        /// The claims directory.
        dir: String,
        /// The I/O error.
        cause: std::io::Error,
    },
}

/// This host's view of the machine's claims.
#[derive(Debug, Clone)]
pub(crate) struct UidClaims {
    dir: PathBuf,
    me: Claim,
}

impl UidClaims {
    /// Claims in `dir` for the host whose data dir is `data_dir` (which must exist).
    pub(crate) fn new(dir: PathBuf, data_dir: &Path) -> Result<UidClaims, ClaimError> {
        let stat = rustix::fs::stat(data_dir)
            .map_err(|e| ClaimError::Io { dir: dir.display().to_string(), cause: e.into() })?;
        let me = Claim {
            data_dir: data_dir.display().to_string(),
            dev: stat.st_dev,
            ino: stat.st_ino,
            provider: String::new(),
        };
        Ok(UidClaims { dir, me })
    }

    fn io(&self, source: impl Into<std::io::Error>) -> ClaimError {
        ClaimError::Io { dir: self.dir.display().to_string(), cause: source.into() }
    }

    /// The claims directory, made if missing (root's, 0700), locked: one host changes claims at a time.
    fn locked(&self) -> Result<OwnedFd, ClaimError> {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&self.dir)
            .map_err(|e| self.io(e))?;
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let dir = rustix::fs::open(&self.dir, flags, Mode::empty()).map_err(|e| self.io(e))?;
        rustix::fs::flock(&dir, FlockOperation::LockExclusive).map_err(|e| self.io(e))?;
        Ok(dir)
    }

    fn mine(&self, provider: &str) -> Claim {
        Claim { provider: provider.to_owned(), ..self.me.clone() }
    }

    /// The claim on `uid`, if there is one that reads.
    fn read(&self, dir: &OwnedFd, uid: u32) -> Result<Option<Claim>, ClaimError> {
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(dir, uid.to_string(), flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(self.io(e)),
        };
        let mut text = String::new();
        use std::io::Read;
        std::fs::File::from(fd).take(MAX_CLAIM_BYTES).read_to_string(&mut text).map_err(|e| self.io(e))?;
        // One that does not read is held all the same: it is not ours to take.
        Ok(Some(serde_json::from_str(&text).unwrap_or(Claim {
            data_dir: "(an unreadable claim)".into(),
            dev: 0,
            ino: 0,
            provider: String::new(),
        })))
    }

    fn write(&self, dir: &OwnedFd, uid: u32, claim: &Claim, replace: bool) -> Result<bool, ClaimError> {
        let name = uid.to_string();
        let text = serde_json::to_vec(claim).map_err(|e| self.io(std::io::Error::other(e)))?;
        let partial = format!(".{name}.new");
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(dir, &partial, flags, Mode::from_raw_mode(0o600)).map_err(|e| self.io(e))?;
        let mut file = std::fs::File::from(fd);
        std::io::Write::write_all(&mut file, &text).and_then(|()| file.sync_all()).map_err(|e| self.io(e))?;
        let renamed = if replace {
            rustix::fs::renameat(dir, &partial, dir, &name)
        } else {
            rustix::fs::renameat_with(dir, &partial, dir, &name, rustix::fs::RenameFlags::NOREPLACE)
        };
        match renamed {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::EXIST) => {
                let _ = rustix::fs::unlinkat(dir, &partial, rustix::fs::AtFlags::empty());
                Ok(false)
            }
            Err(e) => Err(self.io(e)),
        }
    }

    /// Whether a claim's host is gone (its data dir is not the one it claimed
    /// from) and no process runs as `uid`.
    fn stale(claim: &Claim, uid: u32) -> bool {
        let same_dir =
            rustix::fs::stat(claim.data_dir.as_str()).is_ok_and(|s| s.st_dev == claim.dev && s.st_ino == claim.ino);
        !same_dir && claim.dev != 0 && !runs_processes(uid)
    }

    /// Make sure `uid`, recorded for `provider` by this host, is claimed by it:
    /// claimed now if no one has (a host from before claims), refused if
    /// another host or provider holds it.
    pub(crate) fn confirm(&self, provider: &str, uid: u32) -> Result<(), ClaimError> {
        let dir = self.locked()?;
        let mine = self.mine(provider);
        match self.read(&dir, uid)? {
            Some(claim) if claim == mine => Ok(()),
            None => match self.write(&dir, uid, &mine, false)? {
                true => Ok(()),
                false => self.confirm(provider, uid),
            },
            // This host's data dir was moved or restored: the claim follows it.
            Some(claim) if claim.provider == provider && Self::stale(&claim, uid) => {
                self.write(&dir, uid, &mine, true).map(drop)
            }
            Some(claim) => Err(self.taken(uid, claim)),
        }
    }

    /// The first uid from `from` (below `end`) that no one holds (or whose
    /// claim is stale), claimed for `provider`.
    pub(crate) fn claim_from(&self, provider: &str, from: u32, end: u32) -> Result<Option<u32>, ClaimError> {
        let dir = self.locked()?;
        let mine = self.mine(provider);
        for uid in from..end {
            match self.read(&dir, uid)? {
                None => {
                    if self.write(&dir, uid, &mine, false)? {
                        return Ok(Some(uid));
                    }
                }
                Some(claim) if claim == mine => return Ok(Some(uid)),
                Some(claim) if Self::stale(&claim, uid) => {
                    self.write(&dir, uid, &mine, true)?;
                    return Ok(Some(uid));
                }
                Some(_) => {}
            }
        }
        Ok(None)
    }

    /// Give up a claim this host made for `provider` and did not use (another load won the race).
    pub(crate) fn release(&self, provider: &str, uid: u32) -> Result<(), ClaimError> {
        let dir = self.locked()?;
        if self.read(&dir, uid)? == Some(self.mine(provider)) {
            rustix::fs::unlinkat(&dir, uid.to_string(), rustix::fs::AtFlags::empty()).map_err(|e| self.io(e))?;
        }
        Ok(())
    }

    fn taken(&self, uid: u32, claim: Claim) -> ClaimError {
        ClaimError::Taken {
            uid,
            provider: crate::error_text::escape_unprintable(&claim.provider).into_owned(),
            data_dir: crate::error_text::escape_unprintable(&claim.data_dir).into_owned(),
            file: self.dir.join(uid.to_string()).display().to_string(),
        }
    }
}

/// Whether any process of the machine runs as `uid` (real uid).
fn runs_processes(uid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else { return true };
    entries.flatten().any(|entry| {
        let is_pid = entry.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()));
        is_pid && rustix::fs::stat(entry.path()).is_ok_and(|s| s.st_uid == uid)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_hosts_never_claim_one_uid_and_a_gone_hosts_claim_is_taken_again() {
        let dir = tempfile::tempdir().unwrap();
        let claims_dir = dir.path().join("uids");
        let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir(&a_dir).unwrap();
        std::fs::create_dir(&b_dir).unwrap();
        let a = UidClaims::new(claims_dir.clone(), &a_dir).unwrap();
        let b = UidClaims::new(claims_dir.clone(), &b_dir).unwrap();
        // A uid no process runs as on this machine.
        let base = 3_900_000_000;
        assert_eq!(a.claim_from("kvm", base, base + 10).unwrap(), Some(base));
        assert_eq!(
            b.claim_from("kvm", base, base + 10).unwrap(),
            Some(base + 1),
            "the same provider name on another host"
        );
        assert_eq!(a.claim_from("kvm", base, base + 10).unwrap(), Some(base), "a's own claim");
        a.confirm("kvm", base).unwrap();
        // b's store recorded a's uid (hosts from before claims): refused, naming a.
        let clash = b.confirm("fake", base).unwrap_err();
        assert!(matches!(clash, ClaimError::Taken { .. }), "{clash}");
        assert!(clash.to_string().contains(&a_dir.display().to_string()), "{clash}");
        // An unclaimed recorded uid is claimed at once.
        b.confirm("lxd", base + 5).unwrap();
        assert!(a.confirm("lxd", base + 5).is_err());
        // a's data dir goes (and nothing runs as the uid): its claim is stale.
        std::fs::remove_dir(&a_dir).unwrap();
        assert_eq!(b.claim_from("new", base, base + 10).unwrap(), Some(base));
        assert_eq!(b.claim_from("full", base, base + 2).unwrap(), None, "range used up");
        // A claim that does not read is never taken.
        std::fs::write(claims_dir.join((base + 2).to_string()), "garbage").unwrap();
        assert_eq!(b.claim_from("next", base + 2, base + 4).unwrap(), Some(base + 3));
        b.release("next", base + 3).unwrap();
        assert!(!claims_dir.join((base + 3).to_string()).exists());
    }
}
