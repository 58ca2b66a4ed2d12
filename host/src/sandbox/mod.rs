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
mod exec;

pub use exec::LIMITS;

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
    #[error("cannot share {path} with the sandbox user {uid}: {source}")]
    Share {
        /// The file or directory shared.
        path: String,
        /// The sandbox user.
        uid: u32,
        /// Why the ACL could not be set.
        source: std::io::Error,
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
pub const BASE_ENV: [&str; 6] = ["LANG", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "TERM"];

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
pub fn check_env_grant(names: &[String]) -> Result<(), SandboxError> {
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
pub fn check_env(env: &[(String, String)], granted: &[String]) -> Result<(), SandboxError> {
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
    pub uid_base: Option<u32>,
}

pub(crate) const DEFAULT_UID_BASE: u32 = 2_000_000_000;
/// The range of per-provider uids the store hands out: base .. base + this;
/// the next range up is for sandboxes without a store.
pub const UID_RANGE: u32 = 1 << 24;

/// Where per-provider uids are kept, so that one is never reused for another provider.
pub trait UidAllocations: Send + Sync {
    /// The uid of `provider`, allocating the next free one from `base` if it has none.
    fn uid_for(&self, provider: &str, base: u32) -> Result<u32, String>;
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
pub const MIN_BWRAP: &str = "0.8.0";

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
                let uid = allocations.uid_for(provider, base).map_err(refuse)?;
                // Kept from an earlier `uid-base`: its range may hold root or the kit's uids.
                if !(base..base + UID_RANGE).contains(&uid) {
                    return Err(refuse(format!(
                        "its uid {uid} was allocated outside `[sandbox] uid-base = {base}`'s range \
                         {base}..{}: was uid-base changed? Set it back",
                        base + UID_RANGE
                    )));
                }
                Ok(uid)
            }
            None => {
                let hash = provider.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
                Ok(base + UID_RANGE + hash % UID_RANGE)
            }
        }
    }

    /// The confinement of one provider's programs. Shares its data dir with
    /// its user and gives it the granted devices.
    pub fn confine(&self, provider: &str, grants: &Grants<'_>) -> Result<Confinement, SandboxError> {
        let bwrap = self.bwrap()?;
        let uid = self.uid_for(provider)?;
        let share = |path: &Path, source| SandboxError::Share { path: path.display().to_string(), uid, source };
        // Without root the host cannot switch users: its programs run as the host's
        // own (unprivileged) user, in the same namespaces, and nothing needs sharing.
        if running_as_root() {
            // bubblewrap runs as the sandbox user and must reach what it binds.
            acl::grant_search_to_ancestors(grants.data_dir, uid).map_err(|e| share(grants.data_dir, e))?;
            acl::share_data_dir(grants.data_dir, uid).map_err(|e| share(grants.data_dir, e))?;
            for (path, writable) in
                grants.paths.iter().map(|p| (p, false)).chain(grants.paths_rw.iter().map(|p| (p, true)))
            {
                acl::grant_search_to_ancestors(path, uid).map_err(|e| share(path, e))?;
                acl::share_granted(path, uid, writable).map_err(|e| share(path, e))?;
            }
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
            match std::fs::symlink_metadata(device) {
                Ok(meta) => {
                    use std::os::unix::fs::FileTypeExt;
                    if !meta.file_type().is_char_device() && !meta.file_type().is_block_device() {
                        return Err(SandboxError::BadDevice(device.display().to_string()));
                    }
                    if running_as_root() {
                        acl::grant_device(device, uid).map_err(|e| share(device, e))?;
                    }
                    devices.push(device.clone());
                }
                // A device this machine lacks (no /dev/kvm): the program finds it missing, as it would anyway.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(share(device, e)),
            }
        }
        Ok(Confinement {
            bwrap,
            uid,
            data_dir: grants.data_dir.to_owned(),
            paths: grants.paths.to_vec(),
            paths_rw: grants.paths_rw.to_vec(),
            devices,
            share_net: grants.share_net,
        })
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
    /// Stay in the host's network namespace (bridging and taps are granted).
    pub share_net: bool,
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
    data_dir: PathBuf,
    paths: Vec<PathBuf>,
    paths_rw: Vec<PathBuf>,
    devices: Vec<PathBuf>,
    share_net: bool,
}

/// The device nodes bubblewrap's minimal `/dev` has.
const STANDARD_DEVICES: [&str; 6] = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"];

/// Top-level system directories the programs need (read-only), as links
/// where the host has them as links (merged /usr).
const SYSTEM_DIRS: [&str; 6] = ["/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"];

impl Confinement {
    pub(crate) fn uid(&self) -> u32 {
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
        if !program.starts_with("/usr") {
            command.arg("--ro-bind").arg(program).arg(program);
        }
        command.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
        command.arg("--bind").arg(&self.data_dir).arg(&self.data_dir);
        for path in &self.paths {
            // bubblewrap's /dev has these already; other device nodes need `devices`
            // (a path bind is mounted nodev).
            if STANDARD_DEVICES.iter().any(|d| path == Path::new(d)) {
                continue;
            }
            // A granted path the host lacks (yet) is absent in the sandbox too.
            command.arg("--ro-bind-try").arg(path).arg(path);
        }
        for path in &self.paths_rw {
            command.arg("--bind-try").arg(path).arg(path);
        }
        for device in &self.devices {
            command.arg("--dev-bind").arg(device).arg(device);
        }
        command.args(["--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]);
        // No nested user namespaces: they would give the program capabilities over
        // namespaces of its own, the kernel's widest attack surface for an unprivileged user.
        command.arg("--disable-userns");
        if !self.share_net {
            command.arg("--unshare-net");
        }
        if lifetime == Lifetime::Call {
            command.arg("--die-with-parent");
        }
        command.arg("--chdir").arg(&self.data_dir).arg("--clearenv");
        command.args(["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"]);
        command.arg("--setenv").arg("HOME").arg(&self.data_dir);
        for (name, value) in env {
            command.arg("--setenv").arg(name).arg(value);
        }
        command.arg("--").arg(program).args(args);
        exec::confine_before_exec(&mut command);
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
            fn uid_for(&self, _: &str, _: u32) -> Result<u32, String> {
                Ok(self.0)
            }
        }
        let kept = |uid| Sandbox::new(SandboxConfig::default(), Some(Arc::new(Kept(uid)))).uid_for("kvm");
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

    #[test]
    fn a_granted_device_is_a_node_under_dev_named_plainly() {
        let dir = tempfile::tempdir().unwrap();
        let sandbox = Sandbox::default();
        let confine = |device: &str| {
            let devices = [PathBuf::from(device)];
            let grants =
                Grants { data_dir: dir.path(), paths: &[], paths_rw: &[], devices: &devices, share_net: false };
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
