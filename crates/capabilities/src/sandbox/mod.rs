//! The confinement of the programs a provider may run.
//!
//! A granted program runs under bubblewrap (Debian's `bubblewrap`, the
//! sandbox Flatpak uses), started as the provider's own unprivileged user,
//! in mount, pid, ipc, uts and cgroup namespaces of its own (and a network
//! namespace of its own unless the provider is granted bridging, whose taps
//! live in the host's). The only files it sees are the system's programs and
//! libraries (`/usr`, read-only), the provider's data dir, the paths its
//! manifest grants (read-only unless listed in `paths-rw`) and the devices it
//! grants. It runs with `no_new_privs`, no capabilities, an environment of
//! allow-listed names only, no inherited descriptors but 0-2, resource limits,
//! and a session of its own. Arguments the host rewrites (`/data/…`) are a
//! convenience: the wall is the mount namespace, which does not parse anything.
//!
//! Why bubblewrap rather than the same steps natively: those steps (a new
//! root, bind mounts, pivot_root, dropping capabilities, uid maps) would run
//! between `fork` and `exec` of a multi-threaded host, where only
//! async-signal-safe calls are allowed; bubblewrap is a small, audited,
//! single-threaded program that does exactly this, unprivileged.

pub mod acl;
pub mod beneath;
pub mod cgroups;
pub mod claims;
mod exec;
pub mod granted;
pub mod scratch;

/// What all of one provider's programs may take together (`[limits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgramLimits {
    /// Memory of all of them, their `/tmp` included, in MiB.
    pub memory_mib: u64,
    /// Their processes and threads.
    pub pids: u64,
    /// Their shared `/tmp` and `/dev/shm`, in MiB.
    pub tmp_mib: u64,
}

impl Default for ProgramLimits {
    fn default() -> Self {
        // `[limits]`' defaults: program-memory-mib, program-pids, tmp-mib.
        ProgramLimits { memory_mib: 1024, pids: 512, tmp_mib: 64 }
    }
}

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a provider's programs cannot be confined or run as asked.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// No `bwrap` on the PATH, and none configured.
    #[error(
        "bubblewrap (`bwrap`) was not found on the host's PATH: granted programs run only confined (apt-get install bubblewrap)"
    )]
    NoBubblewrap,
    /// `bwrap` is there but too old or does not run.
    #[error("{path}: {reason}; granted programs run only confined by bubblewrap {MIN_BWRAP} or later")]
    BubblewrapUnusable {
        /// The `bwrap` binary.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A variable neither in [`BASE_ENV`] nor granted.
    #[error("environment variable {0:?} may not be passed to a granted program (allowed: {allowed}; a manifest may grant more in `env = [...]`)", allowed = BASE_ENV.join(", "))]
    EnvDenied(String),
    /// A variable no manifest may grant (loader, libc, interpreters), or a malformed name.
    #[error("environment variable {0:?} can never be granted: the dynamic loader and libc act on it")]
    EnvNeverGranted(String),
    /// A granted device that is not a plain device node under `/dev`.
    #[error("granted device {0:?} must be a character or block device node under /dev, named without links or `..`")]
    BadDevice(String),
    /// A POSIX ACL for the sandbox user could not be set.
    #[error("cannot share {path} with the sandbox user {uid}: {}", crate::error_text::cause_text(.cause))]
    Share {
        /// The file or directory shared.
        path: String,
        /// The sandbox user.
        uid: u32,
        /// Why the ACL could not be set.
        cause: std::io::Error,
    },
    /// A granted path the host will not act on: a link in it, or where another can replace it.
    #[error("granted path {path} is refused: {reason}")]
    GrantedPath {
        /// The path as granted.
        path: String,
        /// Why.
        reason: String,
    },
    /// The programs' bounds (their cgroup, their `/tmp`) could not be set up.
    #[error("cannot bound provider {provider:?}'s programs ({what}): {}", crate::error_text::cause_text(.cause))]
    Bounds {
        /// The provider.
        provider: String,
        /// Which bound.
        what: &'static str,
        /// Why.
        cause: std::io::Error,
    },
    /// No uid could be allocated or recorded for the provider.
    #[error("cannot allocate a sandbox user for provider {provider:?}: {reason}")]
    User {
        /// The provider.
        provider: String,
        /// Why not.
        reason: String,
    },
}

/// Names a guest may set in a granted program's environment without a grant.
pub(crate) const BASE_ENV: [&str; 6] = ["LANG", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "TERM"];

/// Names no manifest can grant: the dynamic loader, libc and common
/// interpreters load code or files named by them.
fn never_granted(name: &str) -> bool {
    const UNSAFE: [&str; 17] = [
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_TRACE",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
        "PATH",
        "BASH_ENV",
        "ENV",
        "IFS",
    ];
    name.starts_with("LD_")
        || name.starts_with("MALLOC_")
        || name.starts_with("PYTHON")
        || name.starts_with("PERL")
        || UNSAFE.contains(&name)
}

/// Check the names a manifest grants (`env = [...]`).
pub(crate) fn check_env_grant(names: &[String]) -> Result<(), SandboxError> {
    for name in names {
        let plain =
            !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !plain || never_granted(name) {
            return Err(SandboxError::EnvNeverGranted(name.clone()));
        }
    }
    Ok(())
}

/// Check the environment a guest asks for against the allow-list and `granted`.
pub(crate) fn check_env(env: &[(String, String)], granted: &[String]) -> Result<(), SandboxError> {
    for (name, _) in env {
        if never_granted(name) {
            return Err(SandboxError::EnvNeverGranted(name.clone()));
        }
        if !BASE_ENV.contains(&name.as_str()) && !granted.contains(name) {
            return Err(SandboxError::EnvDenied(name.clone()));
        }
    }
    Ok(())
}

/// `DATA_DIR/host.toml`, `[sandbox]`: how granted programs are confined.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct SandboxConfig {
    /// The bubblewrap binary (default: `bwrap` on the PATH).
    pub bwrap: Option<PathBuf>,
    /// One uid for every provider's programs instead of a uid per provider.
    pub user: Option<u32>,
    /// First uid of the per-provider range (default 2000000000).
    pub(crate) uid_base: Option<u32>,
    /// The machine's directory of uid claims, shared by every broker host on
    /// it (default `/var/lib/wasm-broker/uids`).
    pub(crate) uid_claims: Option<PathBuf>,
}

pub(crate) const DEFAULT_UID_BASE: u32 = 2_000_000_000;
/// The range of per-provider uids the store hands out: base .. base + this;
/// the next range up is for sandboxes without a store.
pub(crate) const UID_RANGE: u32 = 1 << 24;

/// Where per-provider uids are kept, so that one is never reused for another provider.
pub trait UidAllocations: Send + Sync {
    /// The data dir of the host these allocations belong to (what its claims name).
    fn host_dir(&self) -> &Path;
    /// The uid recorded for `provider`, if it has one.
    fn recorded(&self, provider: &str) -> Result<Option<u32>, String>;
    /// The first uid this host has not handed out, at least `base`.
    fn next_free(&self, base: u32) -> Result<u32, String>;
    /// Record `uid` as `provider`'s (and none below it handed out again); the
    /// uid recorded for it, which is another if a load at the same time won.
    fn record(&self, provider: &str, uid: u32) -> Result<u32, String>;
    /// The host paths (granted paths, devices, the data dir) shared with `provider`'s user.
    fn shared(&self, provider: &str) -> Result<Vec<PathBuf>, String>;
    /// Record what is shared with `provider`'s user (before sharing it: a crash
    /// midway leaves the record wider than the ACLs, never narrower).
    fn record_shared(&self, provider: &str, paths: &[PathBuf]) -> Result<(), String>;
}

/// A failure to find bubblewrap, kept to be said again on each load.
#[derive(Debug)]
struct BwrapError(SandboxError);

impl Clone for BwrapError {
    fn clone(&self) -> Self {
        BwrapError(match &self.0 {
            SandboxError::BubblewrapUnusable { path, reason } => {
                SandboxError::BubblewrapUnusable { path: path.clone(), reason: reason.clone() }
            }
            _ => SandboxError::NoBubblewrap,
        })
    }
}

/// The oldest bubblewrap with `--disable-userns`.
pub(crate) const MIN_BWRAP: &str = "0.8.0";

/// The host's sandbox: bubblewrap and who the programs run as.
#[derive(Clone)]
pub struct Sandbox {
    config: SandboxConfig,
    allocations: Option<Arc<dyn UidAllocations>>,
    /// bubblewrap's path once found new enough (asked once per host).
    bwrap: Arc<std::sync::OnceLock<Result<PathBuf, BwrapError>>>,
}

impl Default for Sandbox {
    fn default() -> Self {
        Sandbox::new(SandboxConfig::default(), None)
    }
}

impl Sandbox {
    /// `allocations`: durable per-provider uids (the store); without it a uid is
    /// derived from the provider's name (tests, the conformance kit's recordings).
    pub fn new(config: SandboxConfig, allocations: Option<Arc<dyn UidAllocations>>) -> Self {
        Sandbox { config, allocations, bwrap: Arc::default() }
    }

    fn bwrap(&self) -> Result<PathBuf, SandboxError> {
        self.bwrap.get_or_init(|| self.find_bwrap().map_err(BwrapError)).clone().map_err(|BwrapError(e)| e)
    }

    /// bubblewrap, if it is there and new enough.
    fn find_bwrap(&self) -> Result<PathBuf, SandboxError> {
        let path = match &self.config.bwrap {
            Some(path) => path.clone(),
            None => {
                let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
                let found = std::env::split_paths(&search).map(|d| d.join("bwrap")).find(|p| p.is_file());
                found.ok_or(SandboxError::NoBubblewrap)?
            }
        };
        let unusable = |reason: String| SandboxError::BubblewrapUnusable { path: path.display().to_string(), reason };
        let out = std::process::Command::new(&path)
            .arg("--version")
            .env_clear()
            .output()
            .map_err(|e| unusable(format!("cannot run it: {e}")))?;
        let said = String::from_utf8_lossy(&out.stdout);
        let version = said.trim().strip_prefix("bubblewrap ").unwrap_or_default();
        if !out.status.success() || !at_least(version, MIN_BWRAP) {
            let shown = crate::error_text::escape_unprintable(said.trim()).chars().take(80).collect::<String>();
            return Err(unusable(format!("it says {shown:?} to --version")));
        }
        Ok(path)
    }

    /// The uid `provider`'s programs run as. Never root; uids the store hands
    /// out (`base ..`) and uids derived from names (`base + UID_RANGE ..`, for
    /// throwaway sandboxes such as the conformance kit's) never meet, so a
    /// kit run never shares a user with a registered provider.
    pub fn uid_for(&self, provider: &str) -> Result<u32, SandboxError> {
        let refuse = |reason: String| SandboxError::User { provider: provider.to_owned(), reason };
        if let Some(uid) = self.config.user {
            return match uid {
                0 => Err(refuse("`[sandbox] user = 0` would run granted programs as root".into())),
                uid => Ok(uid),
            };
        }
        let base = self.config.uid_base.unwrap_or(DEFAULT_UID_BASE);
        if base == 0 || base.checked_add(2 * UID_RANGE).is_none() {
            return Err(refuse(format!(
                "`[sandbox] uid-base = {base}` leaves no room for {} uids above it, or includes root",
                2 * UID_RANGE
            )));
        }
        match &self.allocations {
            Some(allocations) => {
                let end = base + UID_RANGE;
                // Without root no user is switched to: there is nothing to claim.
                let claims = match running_as_root() {
                    true => Some(
                        claims::UidClaims::new(
                            self.config.uid_claims.clone().unwrap_or_else(|| claims::DEFAULT_CLAIMS_DIR.into()),
                            allocations.host_dir(),
                        )
                        .map_err(|e| refuse(e.to_string()))?,
                    ),
                    false => None,
                };
                let uid = match allocations.recorded(provider).map_err(refuse)? {
                    Some(uid) => {
                        // Kept from an earlier `uid-base`: its range may hold root or the kit's uids.
                        if !(base..end).contains(&uid) {
                            return Err(refuse(format!(
                                "its uid {uid} was allocated outside `[sandbox] uid-base = {base}`'s range \
                                 {base}..{end}: was uid-base changed? Set it back"
                            )));
                        }
                        if let Some(claims) = &claims {
                            claims.confirm(provider, uid).map_err(|e| refuse(e.to_string()))?;
                        }
                        uid
                    }
                    None => {
                        let from = allocations.next_free(base).map_err(refuse)?;
                        let used_up = || refuse(format!("the sandbox uid range from {base} is used up"));
                        let uid = match &claims {
                            Some(claims) => claims
                                .claim_from(provider, from.max(base), end)
                                .map_err(|e| refuse(e.to_string()))?
                                .ok_or_else(used_up)?,
                            None if from < end => from,
                            None => return Err(used_up()),
                        };
                        let recorded = allocations.record(provider, uid).map_err(refuse)?;
                        if let (Some(claims), true) = (&claims, recorded != uid) {
                            claims.release(provider, uid).map_err(|e| refuse(e.to_string()))?;
                        }
                        recorded
                    }
                };
                Ok(uid)
            }
            None => Ok(base + UID_RANGE + name_hash(provider) % UID_RANGE),
        }
    }

    /// The confinement of one provider's programs. Opens its data dir, its
    /// granted paths and programs once, following no link (see [`granted`]),
    /// shares them with its user through those descriptors, and gives it the
    /// granted devices. What an earlier load shared and this one no longer
    /// grants is taken back.
    pub fn confine(&self, provider: &str, grants: &Grants<'_>) -> Result<Confinement, SandboxError> {
        let bwrap = self.bwrap()?;
        let uid = self.uid_for(provider)?;
        let share = |path: &Path, source| SandboxError::Share { path: path.display().to_string(), uid, cause: source };
        let data_dir = granted::open_unlinked(grants.data_dir)?.ok_or_else(|| {
            share(grants.data_dir, std::io::Error::new(std::io::ErrorKind::NotFound, "the data dir is missing"))
        })?;
        let mut binds = vec![granted::Bound { fd: data_dir, at: grants.data_dir.to_owned(), writable: true }];
        let asked = grants.paths.iter().map(|p| (p, false)).chain(grants.paths_rw.iter().map(|p| (p, true)));
        for (path, writable) in asked {
            // bubblewrap's /dev has these already; other device nodes need `devices`.
            if STANDARD_DEVICES.iter().any(|d| path == Path::new(d)) {
                continue;
            }
            // A granted path the host lacks (yet) is absent in the sandbox too.
            if let Some(fd) = granted::open_unlinked(path)? {
                binds.push(granted::Bound { fd, at: path.clone(), writable });
            }
        }
        let programs: Vec<&PathBuf> = grants.programs.iter().filter(|p| !p.starts_with("/usr")).collect();
        for &program in &programs {
            let fd = granted::open_unlinked(program)?.ok_or_else(|| {
                share(program, std::io::Error::new(std::io::ErrorKind::NotFound, "the granted program is missing"))
            })?;
            binds.push(granted::Bound { fd, at: program.clone(), writable: false });
        }
        let mut devices = Vec::new();
        for device in grants.devices {
            // By its bytes: `Path::components` would quietly drop a `.` or a doubled `/`.
            let text = device.to_str().unwrap_or_default();
            let plain = text
                .strip_prefix("/dev/")
                .is_some_and(|rest| rest.split('/').all(|part| !part.is_empty() && part != "." && part != ".."));
            if !plain {
                return Err(SandboxError::BadDevice(device.display().to_string()));
            }
            // The node itself, never what a link names (`/dev/disk/by-id/...`): the grant names one device.
            match granted::open_unlinked(device) {
                Ok(Some(fd)) => {
                    use std::os::unix::fs::FileTypeExt;
                    let meta = std::fs::symlink_metadata(device).map_err(|e| share(device, e))?;
                    let stat = rustix::fs::fstat(&fd).map_err(|e| share(device, e.into()))?;
                    let kind = rustix::fs::FileType::from_raw_mode(stat.st_mode);
                    let is_node =
                        matches!(kind, rustix::fs::FileType::CharacterDevice | rustix::fs::FileType::BlockDevice);
                    if !is_node || !(meta.file_type().is_char_device() || meta.file_type().is_block_device()) {
                        return Err(SandboxError::BadDevice(device.display().to_string()));
                    }
                    devices.push((device.clone(), fd));
                }
                // A device this machine lacks (no /dev/kvm): the program finds it missing, as it would anyway.
                Ok(None) => {}
                Err(SandboxError::GrantedPath { .. }) => {
                    return Err(SandboxError::BadDevice(device.display().to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        // Without root the host cannot switch users: its programs run as the host's
        // own (unprivileged) user, in the same namespaces, and nothing needs sharing.
        if running_as_root() {
            let now: Vec<PathBuf> =
                binds.iter().map(|b| b.at.clone()).chain(devices.iter().map(|d| d.0.clone())).collect();
            self.take_back(provider, uid, &now)?;
            for (n, bound) in binds.iter().enumerate() {
                acl::grant_search_to_ancestors(&bound.at, uid).map_err(|e| share(&bound.at, e))?;
                match n {
                    0 => acl::share_data_dir(&bound.fd, uid),
                    _ if programs.iter().any(|p| **p == bound.at) => acl::grant_program(&bound.fd, uid),
                    _ => acl::share_granted(&bound.fd, uid, bound.writable),
                }
                .map_err(|e| share(&bound.at, e))?;
            }
            for (device, node) in &devices {
                acl::grant_device(node, uid).map_err(|e| share(device, e))?;
            }
        }
        granted::bind_order(&mut binds);
        let bounds = |what, source| SandboxError::Bounds { provider: provider.to_owned(), what, cause: source };
        let limits = grants.limits;
        // Without root there is nothing to mount or group: bubblewrap's own sized
        // tmpfs and RLIMIT_AS are what is left (README: confinement by host kind).
        let (group, scratch) = match running_as_root() {
            true => {
                let key = self.bounds_key(provider, uid);
                let group = match cgroups::hierarchy() {
                    Some(hierarchy) => Some(Arc::new(
                        cgroups::ProviderGroup::new(hierarchy, &key, limits.memory_mib, limits.pids)
                            .map_err(|e| bounds("memory and pids cgroup", e))?,
                    )),
                    None => None,
                };
                let scratch = scratch::prepare(&key, uid, limits.tmp_mib).map_err(|e| bounds("/tmp tmpfs", e))?;
                // bubblewrap closes a descriptor once it bound it: one each for /tmp and /dev/shm.
                let again = scratch.try_clone().map_err(|e| bounds("/tmp tmpfs", e))?;
                (group, Some(Arc::new([scratch, again])))
            }
            false => (None, None),
        };
        let devices = devices.into_iter().map(|(device, _)| device).collect();
        let data_dir = grants.data_dir.to_owned();
        Ok(Confinement { bwrap, uid, binds: Arc::new(binds), data_dir, devices, limits, group, scratch })
    }

    /// Take back from `provider`'s user what was shared with it before and is
    /// not in `now`, and record `now` (kept: uids are the store's).
    fn take_back(&self, provider: &str, uid: u32, now: &[PathBuf]) -> Result<(), SandboxError> {
        let Some(records) = &self.allocations else { return Ok(()) };
        let refuse = |reason: String| SandboxError::User { provider: provider.to_owned(), reason };
        let before = records.shared(provider).map_err(refuse)?;
        let mut recorded: Vec<PathBuf> = before.iter().chain(now).cloned().collect();
        recorded.sort();
        recorded.dedup();
        records.record_shared(provider, &recorded).map_err(refuse)?;
        for gone in before.iter().filter(|p| !now.contains(p)) {
            unshare_path(gone, uid);
        }
        records.record_shared(provider, now).map_err(refuse)
    }

    /// The name of `provider`'s cgroup and scratch tmpfs: its uid, which is
    /// its alone; where every provider runs as one `[sandbox] user`, the uid
    /// and the provider's name, so each still has bounds and a
    /// `/tmp` of its own (the uid's files and processes stay shared: README).
    pub(crate) fn bounds_key(&self, provider: &str, uid: u32) -> String {
        match self.config.user {
            // A manifest's name ([a-z0-9-]): no hash, so no two providers can collide.
            Some(_) if provider.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') => {
                format!("{uid}-{provider}")
            }
            Some(_) => format!("{uid}-{:08x}", name_hash(provider)),
            None => uid.to_string(),
        }
    }

    /// Kill what `provider`'s programs left running and drop its scratch tmpfs.
    fn release_bounds(&self, provider: &str, uid: u32) {
        let key = self.bounds_key(provider, uid);
        // Nothing of it runs on: whatever its programs left (daemonized ones too) is killed.
        let killed = cgroups::remove(&key);
        if killed > 0 {
            tracing::warn!(provider, killed, "killed the processes a removed provider's programs left running");
        }
        scratch::remove(&key);
    }

    /// Take back everything shared with `provider`'s user: it is being removed.
    /// What cannot be taken back is logged and stays recorded.
    pub fn release(&self, provider: &str) {
        if !running_as_root() {
            return;
        }
        if let Some(uid) = self.config.user.filter(|uid| *uid != 0) {
            // A user every provider shares: its own bounds go, what is shared with the user stays.
            self.release_bounds(provider, uid);
            return;
        }
        let Some(records) = &self.allocations else { return };
        let (Ok(Some(uid)), Ok(shared)) = (records.recorded(provider), records.shared(provider)) else { return };
        self.release_bounds(provider, uid);
        let kept: Vec<PathBuf> = shared.into_iter().filter(|path| !unshare_path(path, uid)).collect();
        if let Err(error) = records.record_shared(provider, &kept) {
            tracing::warn!(provider, %error, "cannot record what was taken back from the provider's user");
        }
    }
}

/// FNV-1a of a provider's name: stable across releases (uids and bounds are named with it).
fn name_hash(provider: &str) -> u32 {
    provider.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}

/// Take back `uid`'s entries on `path` (followed through no link); whether done.
fn unshare_path(path: &Path, uid: u32) -> bool {
    let result = match granted::open_unlinked(path) {
        Ok(Some(fd)) => acl::unshare(&fd, uid, path).map_err(|e| e.to_string()),
        Ok(None) => Ok(()),
        Err(e) => Err(e.to_string()),
    };
    match result {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(path = %path.display(), uid, %error, "cannot take back a sandbox user's access");
            false
        }
    }
}

/// Whether the dotted `version` is `minimum` or later (numerically, part by part).
fn at_least(version: &str, minimum: &str) -> bool {
    let parts = |v: &str| -> Option<Vec<u32>> { v.split('.').map(|p| p.parse().ok()).collect() };
    match (parts(version), parts(minimum)) {
        (Some(have), Some(need)) => have >= need,
        _ => false,
    }
}

fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// What a provider's manifest grants its programs.
pub struct Grants<'a> {
    /// The provider's data dir, bound read-write at its own path; the programs' working dir.
    pub data_dir: &'a Path,
    /// Host paths bound read-only, at their own paths.
    pub paths: &'a [PathBuf],
    /// Host paths bound read-write, at their own paths.
    pub paths_rw: &'a [PathBuf],
    /// Device nodes under `/dev` to bind in.
    pub devices: &'a [PathBuf],
    /// The granted programs, resolved (those outside `/usr` are bound).
    pub programs: &'a [PathBuf],
    /// What its programs may take together.
    pub limits: ProgramLimits,
}

/// How a program is to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// `run`: dies with the host's call (bubblewrap's `--die-with-parent`).
    Call,
    /// `spawn`: a long-running child that outlives the host.
    Detached,
}

/// One provider's confinement, resolved at load.
#[derive(Debug, Clone)]
pub struct Confinement {
    bwrap: PathBuf,
    uid: u32,
    /// The data dir first, then granted paths and programs, each opened once
    /// without following a link; bound in [`granted::bind_order`].
    binds: Arc<Vec<granted::Bound>>,
    data_dir: PathBuf,
    devices: Vec<PathBuf>,
    limits: ProgramLimits,
    /// The provider's cgroup (`None`: none could be made; `RLIMIT_AS` instead).
    group: Option<Arc<cgroups::ProviderGroup>>,
    /// `O_PATH` descriptor of its scratch tmpfs (`None`: bubblewrap's own, sized).
    scratch: Option<Arc<[std::os::fd::OwnedFd; 2]>>,
}

/// The device nodes bubblewrap's minimal `/dev` has.
const STANDARD_DEVICES: [&str; 6] = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"];

/// Top-level system directories the programs need (read-only), as links
/// where the host has them as links (merged /usr).
const SYSTEM_DIRS: [&str; 6] = ["/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"];

impl Confinement {
    /// The user its programs run as.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// The command that runs `program` confined. `env` must have passed [`check_env`].
    pub fn command(
        &self,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        lifetime: Lifetime,
    ) -> std::process::Command {
        self.command_reporting(program, args, env, lifetime, None, Vec::new())
    }

    /// The first descriptor number past every one a command of this
    /// confinement hands bubblewrap (with `info_fd`): where passed taps go.
    pub(crate) fn next_free_fd(&self, info_fd: Option<i32>) -> i32 {
        use std::os::fd::AsRawFd;
        let scratch = self.scratch.iter().flat_map(|s| s.iter().map(|fd| fd.as_raw_fd()));
        let used = self.binds.iter().map(|b| b.raw()).chain(scratch).chain(info_fd);
        used.max().unwrap_or(2).max(2) + 1
    }

    /// As [`Confinement::command`], bubblewrap writing what it made (the pid
    /// of the sandbox's first process, which lives as long as anything in the
    /// sandbox does) to the descriptor `info_fd` (`--info-fd`).
    pub(crate) fn command_reporting(
        &self,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        lifetime: Lifetime,
        info_fd: Option<i32>,
        taps: Vec<(crate::network::tap::TunRequest, i32)>,
    ) -> std::process::Command {
        use std::os::unix::process::CommandExt;
        let mut command = std::process::Command::new(&self.bwrap);
        command.env_clear().current_dir("/");
        if running_as_root() {
            // std drops the supplementary groups too (setgroups(0)) before setuid.
            command.uid(self.uid).gid(self.uid);
        }
        let mut bind = |kind: &str, path: &Path| {
            command.arg(kind).arg(path).arg(path);
        };
        bind("--ro-bind", Path::new("/usr"));
        for dir in SYSTEM_DIRS {
            let path = Path::new(dir);
            match std::fs::read_link(path) {
                Ok(target) => {
                    command.arg("--symlink").arg(target).arg(path);
                }
                Err(_) if path.is_dir() => {
                    command.arg("--ro-bind").arg(path).arg(path);
                }
                Err(_) => {}
            }
        }
        command.args(["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]);
        command.args(["--proc", "/proc", "--dev", "/dev"]);
        let mut keep: Vec<i32> = self.binds.iter().map(|b| b.raw()).collect();
        match &self.scratch {
            Some(scratch) => {
                use std::os::fd::AsRawFd;
                for (fd, at) in scratch.iter().zip(["/tmp", "/dev/shm"]) {
                    keep.push(fd.as_raw_fd());
                    command.arg("--bind-fd").arg(fd.as_raw_fd().to_string()).arg(at);
                }
            }
            None => {
                let bytes = self.limits.tmp_mib.saturating_mul(1 << 20).to_string();
                for at in ["/tmp", "/dev/shm"] {
                    command.arg("--size").arg(&bytes).arg("--tmpfs").arg(at);
                }
            }
        }
        // By descriptor: what the host opened (and checked) at load is what is bound.
        for bound in self.binds.iter() {
            command.arg(if bound.writable { "--bind-fd" } else { "--ro-bind-fd" });
            command.arg(bound.raw().to_string()).arg(&bound.at);
        }
        for device in &self.devices {
            command.arg("--dev-bind").arg(device).arg(device);
        }
        // bubblewrap's /dev is a tmpfs of no size the program could fill: read-only
        // once its nodes are made (the nodes, /dev/pts and /dev/shm are mounts of their own).
        command.args(["--remount-ro", "/dev"]);
        if let Some(fd) = info_fd {
            command.arg("--info-fd").arg(fd.to_string());
            keep.push(fd);
        }
        command.args(["--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]);
        // No nested user namespaces: they would give the program capabilities over
        // namespaces of its own, the kernel's widest attack surface for an unprivileged user.
        command.arg("--disable-userns");
        // Always a network namespace of its own (loopback only): what a VM needs of
        // the host's network (its taps) reaches it as descriptors the host opened.
        command.arg("--unshare-net");
        if lifetime == Lifetime::Call {
            command.arg("--die-with-parent");
        }
        let data_dir = &self.data_dir;
        command.arg("--chdir").arg(data_dir).arg("--clearenv");
        command.args(["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"]);
        command.arg("--setenv").arg("HOME").arg(data_dir);
        for (name, value) in env {
            command.arg("--setenv").arg(name).arg(value);
        }
        command.arg("--").arg(program).args(args);
        let join = self.group.as_ref().map(|g| g.join_fds()).unwrap_or_default();
        // Without a group, the address space is what is left to bound memory with.
        let address_space = match (&self.group, running_as_root()) {
            (None, true) => self.limits.memory_mib.saturating_mul(1 << 20),
            _ => 0,
        };
        exec::confine_before_exec(&mut command, exec::BeforeExec { keep, join, address_space, taps });
        command
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_and_libc_variables_are_never_granted_and_others_need_a_grant() {
        for name in ["LD_PRELOAD", "LD_LIBRARY_PATH", "GCONV_PATH", "GLIBC_TUNABLES", "PATH", "a-b", ""] {
            assert!(check_env_grant(&[name.to_owned()]).is_err(), "{name}");
        }
        assert!(check_env_grant(&["QEMU_AUDIO_DRV".into()]).is_ok());
        let granted = ["QEMU_AUDIO_DRV".to_owned()];
        let env = |n: &str| vec![(n.to_owned(), "x".to_owned())];
        assert!(check_env(&env("LANG"), &granted).is_ok());
        assert!(check_env(&env("QEMU_AUDIO_DRV"), &granted).is_ok());
        assert!(matches!(check_env(&env("LD_PRELOAD"), &granted), Err(SandboxError::EnvNeverGranted(_))));
        assert!(matches!(check_env(&env("GREETING"), &granted), Err(SandboxError::EnvDenied(_))));
    }

    #[test]
    fn bubblewrap_must_be_new_enough_to_disable_user_namespaces() {
        assert!(at_least("0.8.0", MIN_BWRAP) && at_least("0.11.1", MIN_BWRAP) && at_least("1.0", MIN_BWRAP));
        assert!(!at_least("0.6.1", MIN_BWRAP) && !at_least("0.4.1", MIN_BWRAP) && !at_least("", MIN_BWRAP));
        // Something that is not bubblewrap, named as it in host.toml.
        let fake = Sandbox::new(SandboxConfig { bwrap: Some("/bin/true".into()), ..Default::default() }, None);
        assert!(matches!(fake.bwrap(), Err(SandboxError::BubblewrapUnusable { .. })));
        assert!(Sandbox::default().bwrap().is_ok(), "the host's bubblewrap (scripts/install-test-deps.sh)");
    }

    #[test]
    fn per_provider_uids_without_a_store_are_stable_and_in_range() {
        let sandbox = Sandbox::default();
        let a = sandbox.uid_for("kvm").unwrap();
        assert_eq!(a, sandbox.uid_for("kvm").unwrap());
        assert_ne!(a, sandbox.uid_for("lxd").unwrap());
        // Above the range the store allocates from: a kit run never shares a provider's user.
        assert!((DEFAULT_UID_BASE + UID_RANGE..DEFAULT_UID_BASE + 2 * UID_RANGE).contains(&a));
        let one = Sandbox::new(SandboxConfig { user: Some(4242), ..Default::default() }, None);
        assert_eq!(one.uid_for("kvm").unwrap(), 4242);
        let root = Sandbox::new(SandboxConfig { user: Some(0), ..Default::default() }, None);
        assert!(matches!(root.uid_for("kvm"), Err(SandboxError::User { .. })));
        struct Kept(u32);
        impl UidAllocations for Kept {
            fn host_dir(&self) -> &Path {
                Path::new("/")
            }
            fn recorded(&self, _: &str) -> Result<Option<u32>, String> {
                Ok(Some(self.0))
            }
            fn next_free(&self, base: u32) -> Result<u32, String> {
                Ok(base)
            }
            fn record(&self, _: &str, uid: u32) -> Result<u32, String> {
                Ok(uid)
            }
            fn shared(&self, _: &str) -> Result<Vec<PathBuf>, String> {
                Ok(Vec::new())
            }
            fn record_shared(&self, _: &str, _: &[PathBuf]) -> Result<(), String> {
                Ok(())
            }
        }
        let claims = tempfile::tempdir().unwrap();
        let config = SandboxConfig { uid_claims: Some(claims.path().join("uids")), ..Default::default() };
        let kept = |uid| Sandbox::new(config.clone(), Some(Arc::new(Kept(uid)))).uid_for("kvm");
        assert_eq!(kept(DEFAULT_UID_BASE + 5).unwrap(), DEFAULT_UID_BASE + 5);
        // One kept from an earlier uid-base (0, or the kit's range) is refused, not used.
        for uid in [0, DEFAULT_UID_BASE - 1, DEFAULT_UID_BASE + UID_RANGE] {
            assert!(matches!(kept(uid), Err(SandboxError::User { .. })), "{uid}");
        }
        for base in [0, u32::MAX - UID_RANGE] {
            let sandbox = Sandbox::new(SandboxConfig { uid_base: Some(base), ..Default::default() }, None);
            assert!(matches!(sandbox.uid_for("kvm"), Err(SandboxError::User { .. })), "{base}");
        }
    }

    /// Providers that share one `[sandbox] user` still get a cgroup and a
    /// `/tmp` each, bounded by their own `[limits]`; removing one leaves the other's.
    #[test]
    fn providers_sharing_a_user_keep_bounds_and_a_tmp_of_their_own() {
        let Some(_) = cgroups::hierarchy() else {
            eprintln!("skipped: making cgroups needs root and a cgroupfs");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let uid = 3_900_300_000 + std::process::id() % 1000;
        let sandbox = Sandbox::new(SandboxConfig { user: Some(uid), ..Default::default() }, None);
        let confine = |provider: &str, memory_mib: u64, tmp_mib: u64| {
            let limits = ProgramLimits { memory_mib, pids: 64, tmp_mib };
            let grants =
                Grants { data_dir: dir.path(), paths: &[], paths_rw: &[], devices: &[], programs: &[], limits };
            sandbox.confine(provider, &grants).unwrap()
        };
        let (a, b) = (confine("shared-a", 64, 2), confine("shared-b", 128, 4));
        let (key_a, key_b) = (sandbox.bounds_key("shared-a", uid), sandbox.bounds_key("shared-b", uid));
        assert_ne!(key_a, key_b);
        let memory = |key: &str| {
            let dir = cgroups::dirs_of(key).into_iter().next().expect("the group exists");
            let file = if dir.join("memory.max").exists() { "memory.max" } else { "memory.limit_in_bytes" };
            std::fs::read_to_string(dir.join(file)).unwrap().trim().parse::<u64>().unwrap() >> 20
        };
        assert_eq!((memory(&key_a), memory(&key_b)), (64, 128), "each its own bound, not the last loaded's");
        let size = |key: &str| {
            let stat = nix::sys::statvfs::statvfs(&scratch::mount_point(key)).unwrap();
            (stat.blocks() * stat.fragment_size()) >> 20
        };
        assert_eq!((size(&key_a), size(&key_b)), (2, 4));
        drop((a, b));
        sandbox.release("shared-a");
        assert!(cgroups::dirs_of(&key_a).is_empty() && !scratch::mount_point(&key_a).exists(), "a's are gone");
        assert_eq!(memory(&key_b), 128, "b's stay");
        sandbox.release("shared-b");
        assert!(cgroups::dirs_of(&key_b).is_empty() && !scratch::mount_point(&key_b).exists());
    }

    #[test]
    fn a_granted_device_is_a_node_under_dev_named_plainly() {
        let dir = tempfile::tempdir().unwrap();
        let sandbox = Sandbox::default();
        let confine = |device: &str| {
            let devices = [PathBuf::from(device)];
            let grants = Grants {
                data_dir: dir.path(),
                paths: &[],
                paths_rw: &[],
                devices: &devices,
                programs: &[],
                limits: Default::default(),
            };
            sandbox.confine("p", &grants)
        };
        let bad =
            ["/dev/../etc/passwd", "/dev/./null", "/dev//null", "/dev/null/", "/dev/stdin", "/etc/passwd", "/dev"];
        for bad in bad.into_iter().chain(["dev/null", "/dev/"]) {
            assert!(matches!(confine(bad), Err(SandboxError::BadDevice(_))), "{bad}");
        }
        // One this machine lacks is left out, as the program would find it anyway.
        assert!(confine("/dev/no-such-device").is_ok());
    }
}
