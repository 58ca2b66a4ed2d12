//! `provider.toml`: what a provider is, what it may do, and its limits; the
//! most memory any guest may ask for; and what may be loaded from where
//! (`check_loadable`: nothing from inside the providers' data dirs).
//!
//! ```toml
//! name = "fake"
//! component = "../target/wasm32-wasip2/release/fake.wasm"   # relative to this file
//! sha256 = "…"                   # optional pin
//! isolation = "pooled"           # or "per-call"
//! [limits]
//! memory-mib = 64
//! pool-size = 4                  # warm instances kept (pooled)
//! max-calls = 10000              # an instance is retired after this many calls
//! max-age = "1h"                 # … or this age
//! breaker-failures = 5           # traps/deadlines/limits within breaker-window that put it
//! breaker-window = "60s"         # half-open (0 = off); an all-instances re-observe reopens it
//! call-data-mib = 16             # most data the guest hands the host in one host call or answer
//! max-records = 10000            # most instances in one all-instances answer
//! log-lines-per-second = 100     # over all its calls; a 10 s burst passes, the rest is counted
//! max-concurrent-calls = 32      # more wait up to queue-wait, then are refused as busy
//! queue-wait = "2s"
//! kv-keys = 100000               # its kv namespace: keys, and keys and values in MiB
//! kv-mib = 64
//! data-mib = 1024               # its data dir: a filesystem of its own this size (0 = none)
//! program-memory-mib = 1024      # all its programs together (a cgroup), their /tmp and /dev/shm included
//! program-pids = 512             # processes and threads of all its programs together
//! tmp-mib = 64                   # its programs' /tmp and /dev/shm (one tmpfs, noexec)
//! [limits.deadlines]
//! default = "30s"
//! start-instance = "10m"
//! [grants]
//! kv = true
//! log = true
//! machine-lock = true
//! process = ["qemu-img"]         # programs it may run
//! paths = ["/var/lib/images"]    # host paths their arguments may name
//! local-sockets = true           # unix sockets inside its own data dir (QMP)
//! [grants.http]                  # wasi:http authorities the host routes
//! lxd = "unix:/var/lib/incus/unix.socket"
//! [grants.bridge]                # devices and bridges (`*` suffix = prefix)
//! devices = ["vm-*"]             # it may make; then act on those it made
//! bridges = ["br-vm*"]
//! attach-to = ["br-eth0"]        # host bridges it may attach its own devices to
//! [config]                       # passed to validate-config and the call context as JSON
//! [secrets]                      # config keys the host fills in (broker_capabilities::secrets)
//! api-token = "lxd-prod"         # from DATA_DIR/secrets/lxd-prod (0600, the host's user's)
//! ```

use broker_capabilities::quotas::{self, Quotas};
use broker_capabilities::rooms::kv::KvQuota;
use broker_capabilities::sandbox::ProgramLimits;
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Largest linear memory any provider may ask for.
pub(crate) const MAX_GUEST_MEMORY_BYTES: u64 = 4 << 30;

/// Most a provider may let its guest hand the host in one call (`call-data-mib`).
pub(crate) const MAX_CALL_DATA_MIB: u64 = 1024;
/// Most a provider's kv namespace may hold (`kv-mib`): it is mirrored in memory.
pub(crate) const MAX_KV_MIB: u64 = 1024;
/// Most memory a provider's programs may be given together (`program-memory-mib`): 1 TiB.
const MAX_PROGRAM_MEMORY_MIB: u64 = 1 << 20;
/// Most processes a provider's programs may be given together (`program-pids`).
const MAX_PROGRAM_PIDS: u64 = 65_536;
/// Largest `/tmp` of a provider's programs (`tmp-mib`): 64 GiB (it is memory).
const MAX_TMP_MIB: u64 = 1 << 16;
/// Largest data dir filesystem (`data-mib`): 1 TiB, sparse.
pub(crate) const MAX_DATA_MIB: u64 = 1 << 20;
pub use broker_capabilities::data_fs::MIN_DATA_MIB;
/// Most calls one provider may run at once (`max-concurrent-calls`): the
/// engine's instance pool is shared by every provider.
pub(crate) const MAX_CONCURRENT_CALLS: usize = 128;

/// Why a manifest or its component could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The manifest file could not be read (or is not a regular file).
    #[error("cannot read manifest {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Read {
        /// The manifest.
        path: String,
        /// Why it could not be read.
        cause: std::io::Error,
    },
    /// The text is not an acceptable manifest.
    #[error("invalid manifest {path}: {message}")]
    Invalid {
        /// The manifest.
        path: String,
        /// What is wrong; quotes the file only if it is a provider manifest.
        message: String,
    },
    /// The component the manifest names could not be read.
    #[error("cannot read component {path} named by manifest {manifest}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Component {
        /// The manifest naming it.
        manifest: String,
        /// The component, resolved against the manifest's directory.
        path: String,
        /// Why it could not be read.
        cause: std::io::Error,
    },
    /// The component's bytes do not hash to the manifest's `sha256` pin.
    #[error("component {path} does not match the manifest's sha256 pin: expected {expected}, found {actual}")]
    HashMismatch {
        /// The component.
        path: String,
        /// The pin, lowercase hex.
        expected: String,
        /// The component's SHA-256, lowercase hex.
        actual: String,
    },
}

/// Whether a provider's guest instances are reused across calls (`isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    /// Warm instances reused across calls; thrown away after a trap, a limit, a swap or an age.
    #[default]
    Pooled,
    /// A fresh instance for every call.
    PerCall,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct Limits {
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u64,
    #[serde(default = "default_pool_size")]
    pub pool_size: usize,
    #[serde(default = "default_max_calls")]
    pub max_calls: u64,
    #[serde(default = "default_max_age", deserialize_with = "duration")]
    pub max_age: Duration,
    #[serde(default)]
    pub deadlines: Deadlines,
    /// Crash policy: this many traps, deadline overruns or limits within
    /// `breaker-window` put the provider half-open (0 turns it off).
    #[serde(default = "default_breaker_failures")]
    pub(crate) breaker_failures: usize,
    #[serde(default = "default_breaker_window", deserialize_with = "duration")]
    pub(crate) breaker_window: Duration,
    /// Most data the guest may hand the host in one host call or one answer
    /// (strings and lists as the host holds them once lifted), in MiB.
    #[serde(default = "default_call_data_mib")]
    pub(crate) call_data_mib: u64,
    /// Most instances one `all-instances` answer may hold.
    #[serde(default = "default_max_records")]
    pub(crate) max_records: usize,
    /// Log lines per second the provider may write, over all its calls (a
    /// burst of ten seconds' worth is let through at once).
    #[serde(default = "default_log_lines_per_second")]
    pub log_lines_per_second: u32,
    /// Calls of this provider that run at once; more wait up to `queue-wait`.
    #[serde(default = "default_max_concurrent_calls")]
    pub(crate) max_concurrent_calls: usize,
    /// How long a call waits for a free slot before it is refused as busy.
    #[serde(default = "default_queue_wait", deserialize_with = "duration")]
    pub(crate) queue_wait: Duration,
    /// Most keys in the provider's kv namespace.
    #[serde(default = "default_kv_keys")]
    pub(crate) kv_keys: usize,
    /// Most bytes (keys and values) in the provider's kv namespace, in MiB.
    #[serde(default = "default_kv_mib")]
    pub(crate) kv_mib: u64,
    /// Size of its data dir's own filesystem, in MiB (0: none, on the host's filesystem).
    #[serde(default = "default_data_mib")]
    pub data_mib: u64,
    /// Memory of all its programs together, in MiB (a cgroup of the provider's;
    /// pages of their /tmp count as theirs).
    #[serde(default = "default_program_memory_mib")]
    pub(crate) program_memory_mib: u64,
    /// Processes and threads of all its programs together.
    #[serde(default = "default_program_pids")]
    pub(crate) program_pids: u64,
    /// Size of the one tmpfs its programs share as `/tmp` and `/dev/shm`, in MiB.
    #[serde(default = "default_tmp_mib")]
    pub tmp_mib: u64,
}

fn default_program_memory_mib() -> u64 {
    ProgramLimits::default().memory_mib
}
fn default_program_pids() -> u64 {
    ProgramLimits::default().pids
}
fn default_tmp_mib() -> u64 {
    ProgramLimits::default().tmp_mib
}

fn default_kv_keys() -> usize {
    quotas::DEFAULT_KV_KEYS
}
fn default_kv_mib() -> u64 {
    quotas::DEFAULT_KV_MIB
}
fn default_data_mib() -> u64 {
    1024
}

fn default_call_data_mib() -> u64 {
    16
}
fn default_max_records() -> usize {
    10_000
}
fn default_log_lines_per_second() -> u32 {
    quotas::DEFAULT_LOG_LINES_PER_SECOND
}
fn default_max_concurrent_calls() -> usize {
    32
}
fn default_queue_wait() -> Duration {
    Duration::from_secs(2)
}

fn default_breaker_failures() -> usize {
    5
}
fn default_breaker_window() -> Duration {
    Duration::from_secs(60)
}

fn default_memory_mib() -> u64 {
    128
}
fn default_pool_size() -> usize {
    4
}
fn default_max_calls() -> u64 {
    10_000
}
fn default_max_age() -> Duration {
    Duration::from_secs(3600)
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_mib: default_memory_mib(),
            pool_size: default_pool_size(),
            max_calls: default_max_calls(),
            max_age: default_max_age(),
            deadlines: Deadlines::default(),
            breaker_failures: default_breaker_failures(),
            breaker_window: default_breaker_window(),
            call_data_mib: default_call_data_mib(),
            max_records: default_max_records(),
            log_lines_per_second: default_log_lines_per_second(),
            max_concurrent_calls: default_max_concurrent_calls(),
            queue_wait: default_queue_wait(),
            kv_keys: default_kv_keys(),
            kv_mib: default_kv_mib(),
            data_mib: default_data_mib(),
            program_memory_mib: default_program_memory_mib(),
            program_pids: default_program_pids(),
            tmp_mib: default_tmp_mib(),
        }
    }
}

/// Per-method deadlines; a method without its own uses `default`, except
/// `start-instance`, which defaults to 10 minutes.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct Deadlines {
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) default: Option<Duration>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) describe: Option<Duration>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) validate_config: Option<Duration>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) start_instance: Option<Duration>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) stop_instances: Option<Duration>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) all_instances: Option<Duration>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub(crate) maintain_instance: Option<Duration>,
}

pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
pub(crate) const DEFAULT_START_DEADLINE: Duration = Duration::from_secs(600);

/// The contract's methods, as manifests and errors name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// Name, version and supported features.
    Describe,
    /// Check the manifest's `[config]` before it is used.
    ValidateConfig,
    /// Start one instance.
    StartInstance,
    /// Stop instances by id; unknown ids are ignored.
    StopInstances,
    /// List the instances the provider knows.
    AllInstances,
    /// Run at host start for each recorded instance, with the params it was started with.
    MaintainInstance,
}

impl Method {
    pub(crate) const ALL: [Method; 6] = [
        Method::Describe,
        Method::ValidateConfig,
        Method::StartInstance,
        Method::StopInstances,
        Method::AllInstances,
        Method::MaintainInstance,
    ];

    /// Whether it changes nothing the host records: `describe`,
    /// `validate-config`, `all-instances`.
    pub fn is_read_only(self) -> bool {
        matches!(self, Method::Describe | Method::ValidateConfig | Method::AllInstances)
    }

    /// As manifests (`[limits.deadlines]`) and errors spell it: `start-instance`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Describe => "describe",
            Method::ValidateConfig => "validate-config",
            Method::StartInstance => "start-instance",
            Method::StopInstances => "stop-instances",
            Method::AllInstances => "all-instances",
            Method::MaintainInstance => "maintain-instance",
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Deadlines {
    /// The longest any call may take.
    pub(crate) fn longest(&self) -> Duration {
        Method::ALL.iter().map(|m| self.for_method(*m)).max().unwrap_or(DEFAULT_DEADLINE)
    }

    pub(crate) fn for_method(&self, method: Method) -> Duration {
        let specific = match method {
            Method::Describe => self.describe,
            Method::ValidateConfig => self.validate_config,
            Method::StartInstance => self.start_instance.or(Some(DEFAULT_START_DEADLINE)),
            Method::StopInstances => self.stop_instances,
            Method::AllInstances => self.all_instances,
            Method::MaintainInstance => self.maintain_instance,
        };
        specific.or(self.default).unwrap_or(DEFAULT_DEADLINE)
    }
}

pub use broker_capabilities::rooms::Grants;

impl Limits {
    /// What a provider version's stores share: its kv namespace's bounds, its log rate.
    pub(crate) fn quotas(&self) -> Quotas {
        let kv = KvQuota { keys: self.kv_keys, bytes: (self.kv_mib << 20) as usize };
        Quotas::new(kv, self.log_lines_per_second)
    }

    /// What its granted programs may take together among them.
    pub(crate) fn programs(&self) -> ProgramLimits {
        ProgramLimits { memory_mib: self.program_memory_mib, pids: self.program_pids, tmp_mib: self.tmp_mib }
    }

    /// The bounds that hold a provider to its share of the host which these
    /// loosen against `approved`, each named: like a new grant, the
    /// operator's to approve. (A deadline or a pool's size is the provider's own.)
    pub(crate) fn loosening(&self, approved: &Limits) -> Option<String> {
        // data-mib 0 is no filesystem of its own: no bound at all.
        let data = |mib: u64| if mib == 0 { u64::MAX } else { mib };
        let bounds = [
            ("memory-mib", self.memory_mib, approved.memory_mib),
            ("call-data-mib", self.call_data_mib, approved.call_data_mib),
            ("max-records", self.max_records as u64, approved.max_records as u64),
            ("log-lines-per-second", self.log_lines_per_second.into(), approved.log_lines_per_second.into()),
            ("max-concurrent-calls", self.max_concurrent_calls as u64, approved.max_concurrent_calls as u64),
            ("kv-keys", self.kv_keys as u64, approved.kv_keys as u64),
            ("kv-mib", self.kv_mib, approved.kv_mib),
            ("data-mib", data(self.data_mib), data(approved.data_mib)),
            ("program-memory-mib", self.program_memory_mib, approved.program_memory_mib),
            ("program-pids", self.program_pids, approved.program_pids),
            ("tmp-mib", self.tmp_mib, approved.tmp_mib),
        ];
        let shown = |n: u64| if n == u64::MAX { "0 (unbounded)".to_owned() } else { n.to_string() };
        let loosened: Vec<String> = bounds
            .iter()
            .filter(|(_, now, was)| now > was)
            .map(|(name, now, was)| format!("limits.{name} = {} (approved {})", shown(*now), shown(*was)))
            .collect();
        (!loosened.is_empty()).then(|| loosened.join(", "))
    }
}

impl Manifest {
    /// The provider's name: unique on this host.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What this asks for beyond `approved`: new grants and loosened bounds, named.
    pub fn widening(&self, approved: &Manifest) -> Option<String> {
        // A secret it names that the approved one did not is the operator's to approve too.
        let secrets = self
            .secrets
            .iter()
            .find(|secret| !approved.secrets.contains(secret))
            .map(|(key, name)| format!("secrets.{key} = {name:?}"));
        let wider: Vec<String> = self
            .grants
            .widening(&approved.grants)
            .into_iter()
            .chain(self.limits.loosening(&approved.limits))
            .chain(secrets)
            .collect();
        (!wider.is_empty()).then(|| wider.join(", "))
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawManifest {
    name: String,
    component: PathBuf,
    sha256: Option<String>,
    #[serde(default)]
    isolation: Isolation,
    #[serde(default)]
    limits: Limits,
    #[serde(default, deserialize_with = "broker_capabilities::rooms::deserialize_grants")]
    grants: Grants,
    #[serde(default)]
    config: toml::Table,
    #[serde(default)]
    secrets: std::collections::BTreeMap<String, String>,
}

/// A checked manifest, with the component path resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// The manifest file, as given.
    pub path: PathBuf,
    pub(crate) name: String,
    /// The component file, resolved against the manifest's directory.
    pub component: PathBuf,
    pub(crate) sha256: Option<String>,
    pub(crate) isolation: Isolation,
    pub(crate) limits: Limits,
    /// What the provider may import, and how far.
    pub grants: Grants,
    /// The `[config]` table.
    pub config: toml::Table,
    /// `[secrets]`: config keys the host fills in, each with the secret's name.
    pub secrets: Vec<(String, String)>,
    /// Config values that look like secrets given inline (dotted paths):
    /// `provider add` refuses them; a manifest approved before still loads,
    /// with them hidden from what the host shows.
    pub inline_secrets: Vec<String>,
}

/// The largest manifest the host reads.
/// Whether `name` may name a provider: 1-63 characters of lowercase letters, digits and '-'.
pub fn is_provider_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

pub(crate) const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// Most bytes of a component the host reads (the bundled ones are under 1 MiB).
pub(crate) const MAX_COMPONENT_BYTES: u64 = 64 << 20;

impl Manifest {
    /// Read and parse a manifest. Only a regular file of at most
    /// [`MAX_MANIFEST_BYTES`] is read: a FIFO, a device or a directory is refused
    /// before it is opened for reading, and errors never quote a file that is not
    /// a provider manifest (see [`Manifest::parse`]). The daemon reads as root for
    /// any API caller, so a path to any file must not answer with its content.
    pub fn load(path: &Path) -> Result<Manifest, ManifestError> {
        Manifest::load_with_text(path).map(|(manifest, _)| manifest)
    }

    /// As [`Manifest::load`], with the text it was parsed from (what an operator approved).
    pub(crate) fn load_with_text(path: &Path) -> Result<(Manifest, String), ManifestError> {
        let text = read_manifest_text(path)
            .map_err(|source| ManifestError::Read { path: path.display().to_string(), cause: source })?;
        Ok((Manifest::parse(path, &text)?, text))
    }

    /// Parse manifest text; `path` locates the component and names errors.
    ///
    /// A TOML error is given by line and column. Its message (which may quote a
    /// key or a value) is added only when the text is TOML with `name` and
    /// `component` strings, i.e. a provider manifest: any other file's content is
    /// never quoted.
    pub fn parse(path: &Path, text: &str) -> Result<Manifest, ManifestError> {
        let invalid = |message: String| ManifestError::Invalid { path: path.display().to_string(), message };
        let raw: RawManifest = toml::from_str(text).map_err(|e| invalid(toml_error_text(text, &e)))?;
        if !is_provider_name(&raw.name) {
            return Err(invalid(format!(
                "name {:?} must be 1-63 characters of lowercase letters, digits and '-'",
                raw.name
            )));
        }
        if let Some(pin) = &raw.sha256
            && (pin.len() != 64 || !pin.chars().all(|c| c.is_ascii_hexdigit()))
        {
            return Err(invalid(format!("sha256 {pin:?} must be 64 hex digits")));
        }
        let max_mib = MAX_GUEST_MEMORY_BYTES >> 20;
        if raw.limits.memory_mib == 0 || raw.limits.memory_mib > max_mib {
            return Err(invalid(format!("limits.memory-mib must be between 1 and {max_mib}")));
        }
        if raw.limits.pool_size == 0 {
            return Err(invalid("limits.pool-size must be at least 1".into()));
        }
        if raw.limits.call_data_mib == 0 || raw.limits.call_data_mib > MAX_CALL_DATA_MIB {
            return Err(invalid(format!("limits.call-data-mib must be between 1 and {MAX_CALL_DATA_MIB}")));
        }
        if raw.limits.kv_mib == 0 || raw.limits.kv_mib > MAX_KV_MIB {
            return Err(invalid(format!("limits.kv-mib must be between 1 and {MAX_KV_MIB}")));
        }
        let data_mib = raw.limits.data_mib;
        if data_mib != 0 && !(MIN_DATA_MIB..=MAX_DATA_MIB).contains(&data_mib) {
            return Err(invalid(format!(
                "limits.data-mib must be 0 (no filesystem of its own) or between {MIN_DATA_MIB} and {MAX_DATA_MIB}"
            )));
        }
        if !(16..=MAX_PROGRAM_MEMORY_MIB).contains(&raw.limits.program_memory_mib) {
            return Err(invalid(format!("limits.program-memory-mib must be between 16 and {MAX_PROGRAM_MEMORY_MIB}")));
        }
        if !(8..=MAX_PROGRAM_PIDS).contains(&raw.limits.program_pids) {
            return Err(invalid(format!("limits.program-pids must be between 8 and {MAX_PROGRAM_PIDS}")));
        }
        if !(1..=MAX_TMP_MIB).contains(&raw.limits.tmp_mib) {
            return Err(invalid(format!("limits.tmp-mib must be between 1 and {MAX_TMP_MIB}")));
        }
        if raw.limits.max_records == 0 {
            return Err(invalid("limits.max-records must be at least 1".into()));
        }
        if raw.limits.max_concurrent_calls == 0 || raw.limits.max_concurrent_calls > MAX_CONCURRENT_CALLS {
            return Err(invalid(format!("limits.max-concurrent-calls must be between 1 and {MAX_CONCURRENT_CALLS}")));
        }
        let base = path.parent().unwrap_or(Path::new("."));
        let component = if raw.component.is_absolute() { raw.component.clone() } else { base.join(&raw.component) };
        // The guest gets it as JSON (broker_capabilities::secrets::ProviderConfig): it must be expressible so.
        serde_json::to_string(&raw.config).map_err(|e| invalid(format!("config: {e}")))?;
        if raw.secrets.len() > broker_capabilities::secrets::MAX_SECRETS {
            return Err(invalid(format!(
                "[secrets] names more than {} secrets",
                broker_capabilities::secrets::MAX_SECRETS
            )));
        }
        for (key, name) in &raw.secrets {
            if key.is_empty() || key.len() > 128 {
                return Err(invalid(format!("secrets: config key {key:?} must be 1-128 bytes")));
            }
            if raw.config.contains_key(key) {
                return Err(invalid(format!(
                    "secrets.{key}: config.{key} is given too; a key is either in [config] or filled in from [secrets]"
                )));
            }
            broker_capabilities::secrets::check_name("secret", name)
                .map_err(|e| invalid(format!("secrets.{key}: {e}")))?;
        }
        let inline_secrets = broker_capabilities::secrets::inline_secrets(&raw.config);
        Ok(Manifest {
            path: path.to_owned(),
            name: raw.name,
            component,
            sha256: raw.sha256.map(|s| s.to_ascii_lowercase()),
            isolation: raw.isolation,
            limits: raw.limits,
            grants: raw.grants,
            config: raw.config,
            secrets: raw.secrets.into_iter().collect(),
            inline_secrets,
        })
    }

    /// Refuse config values that look like secrets given inline (`provider
    /// add`): the store would keep them and `provider show` print them.
    pub(crate) fn refuse_inline_secrets(&self) -> Result<(), ManifestError> {
        let Some(first) = self.inline_secrets.first() else { return Ok(()) };
        let key = first.split(['.', '[']).next().unwrap_or(first);
        Err(ManifestError::Invalid {
            path: self.path.display().to_string(),
            message: format!(
                "config.{first} looks like a secret given inline ({} in all): the store would keep it and \
                 `provider show` print it. Put the value in DATA_DIR/{}/NAME (0600, owned by the host's user), \
                 take the key out of [config] and name it under [secrets] (which fills in top-level keys): \
                 {key} = \"NAME\"",
                self.inline_secrets.len(),
                broker_capabilities::secrets::SECRETS_DIR,
            ),
        })
    }

    /// Read the component's bytes, checking the sha256 pin if there is one.
    /// Returns the bytes and their sha256.
    pub(crate) fn read_component(&self) -> Result<(Vec<u8>, String), ManifestError> {
        let bytes =
            read_regular_file(&self.component, MAX_COMPONENT_BYTES).map_err(|source| ManifestError::Component {
                manifest: self.path.display().to_string(),
                path: self.component.display().to_string(),
                cause: source,
            })?;
        let actual = hex::encode(Sha256::digest(&bytes));
        if let Some(expected) = &self.sha256
            && *expected != actual
        {
            return Err(ManifestError::HashMismatch {
                path: self.component.display().to_string(),
                expected: expected.clone(),
                actual,
            });
        }
        Ok((bytes, actual))
    }
}

/// A manifest's text: a regular file of at most [`MAX_MANIFEST_BYTES`] of UTF-8.
fn read_manifest_text(path: &Path) -> std::io::Result<String> {
    let bytes = read_regular_file(path, MAX_MANIFEST_BYTES)?;
    String::from_utf8(bytes).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// The bytes of `path` if it is a regular file of at most `max` bytes:
/// checked before opening and again on the open file, which is opened
/// non-blocking so a FIFO swapped in cannot hang the host, and read no further
/// than `max` (a file that grows while read is refused, not followed).
/// Anything else (a FIFO, a device such as `/dev/zero`, a directory, a
/// socket) is refused with what it is.
pub fn read_regular_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let too_large = || Error::new(ErrorKind::InvalidInput, format!("larger than {max} bytes"));
    let check = |metadata: &std::fs::Metadata| {
        let kind = metadata.file_type();
        let not = |what: &str| Error::new(ErrorKind::InvalidInput, format!("not a regular file ({what})"));
        match () {
            _ if kind.is_file() => {}
            _ if kind.is_dir() => return Err(not("a directory")),
            _ if kind.is_fifo() => return Err(not("a FIFO")),
            _ if kind.is_socket() => return Err(not("a socket")),
            _ if kind.is_char_device() || kind.is_block_device() => return Err(not("a device")),
            _ => return Err(not("of another kind")),
        }
        if metadata.len() > max {
            return Err(too_large());
        }
        Ok(())
    };
    check(&std::fs::metadata(path)?)?;
    // NOCTTY: a terminal swapped in between the check and the open must not
    // become the daemon's controlling terminal.
    let flags = nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_NOCTTY;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(flags.bits()).open(path)?;
    let metadata = file.metadata()?;
    check(&metadata)?;
    let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(too_large());
    }
    Ok(bytes)
}

/// A TOML error as a manifest error says it: where, and what only if `text` is
/// a provider manifest (TOML with `name` and `component` strings). toml's own
/// text quotes the offending line, and its message may quote a key or a value,
/// of whatever file the path named.
fn toml_error_text(text: &str, err: &toml::de::Error) -> String {
    let at = match err.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
            format!("line {line}, column {column}")
        }
        None => "an unknown position".to_owned(),
    };
    match text.parse::<toml::Table>() {
        Ok(table)
            if table.get("name").is_some_and(|v| v.is_str()) && table.get("component").is_some_and(|v| v.is_str()) =>
        {
            format!("{at}: {}", err.message().trim_end())
        }
        Ok(_) => format!(
            "not a provider manifest: it has no `name` and `component` strings (TOML error at {at}; the file is not quoted)"
        ),
        Err(_) => format!(
            "not valid TOML (error at {at}; the file is not quoted, as it is not known to be a provider manifest)"
        ),
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|e| format!("invalid duration {text:?}: {e}"))?;
    if duration.is_zero() {
        return Err(format!("duration {text:?} must be positive"));
    }
    Ok(duration)
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse_duration(&text).map_err(serde::de::Error::custom)
}

fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

/// The host's data dirs root, resolved (a link in its path does not hide it).
fn resolved(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
}

/// Refuse `path` (a manifest or component) if it is inside `data_dirs`.
pub(crate) fn check_loadable(path: &Path, data_dirs: &Path) -> Result<(), String> {
    let root = resolved(data_dirs);
    let target = resolved(path);
    if target.starts_with(&root) {
        return Err(format!(
            "{} is inside the providers' data dirs ({}), which providers can write: the host loads nothing from there",
            path.display(),
            root.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_under_the_data_dirs_is_loadable_even_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(data.join("evil")).unwrap();
        std::fs::write(data.join("evil/provider.toml"), "").unwrap();
        std::os::unix::fs::symlink(data.join("evil"), dir.path().join("innocent")).unwrap();
        assert!(check_loadable(&data.join("evil/provider.toml"), &data).is_err());
        assert!(check_loadable(&dir.path().join("innocent/provider.toml"), &data).is_err());
        assert!(check_loadable(&dir.path().join("providers/x.toml"), &data).is_ok());
    }

    fn parse(text: &str) -> Result<Manifest, ManifestError> {
        Manifest::parse(Path::new("/p/provider.toml"), text)
    }

    #[test]
    fn minimal_manifest_takes_defaults_and_grants_nothing() {
        let m = parse("name = \"x\"\ncomponent = \"x.wasm\"\n").unwrap();
        assert_eq!(m.component, Path::new("/p/x.wasm"));
        assert_eq!(m.isolation, Isolation::Pooled);
        assert_eq!(m.grants, Grants::default());
        assert_eq!(m.limits.deadlines.for_method(Method::StartInstance), DEFAULT_START_DEADLINE);
        assert_eq!(m.limits.deadlines.for_method(Method::AllInstances), DEFAULT_DEADLINE);
        assert_eq!(serde_json::to_string(&m.config).unwrap(), "{}");
    }

    #[test]
    fn unknown_key_is_an_error_with_its_line() {
        let err = parse("name = \"x\"\ncomponent = \"x.wasm\"\n[grants]\nkv = true\nsockets = true\n").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("line 5"), "{text}");
        assert!(text.contains("sockets"), "{text}");
    }

    #[test]
    fn deadlines_and_isolation_parse() {
        let m = parse(
            "name = \"x\"\ncomponent = \"/abs/x.wasm\"\nisolation = \"per-call\"\n\
             [limits.deadlines]\ndefault = \"2s\"\nstart-instance = \"1m\"\n[config]\nzones = [\"a\"]\n",
        )
        .unwrap();
        assert_eq!(m.component, Path::new("/abs/x.wasm"));
        assert_eq!(m.isolation, Isolation::PerCall);
        assert_eq!(m.limits.deadlines.for_method(Method::StopInstances), Duration::from_secs(2));
        assert_eq!(m.limits.deadlines.for_method(Method::StartInstance), Duration::from_secs(60));
        assert_eq!(serde_json::to_string(&m.config).unwrap(), r#"{"zones":["a"]}"#);
    }

    #[test]
    fn loosened_bounds_are_named_like_new_grants_and_tightened_ones_are_not() {
        let with = |limits: &str| parse(&format!("name = \"x\"\ncomponent = \"x\"\n[limits]\n{limits}")).unwrap();
        let approved = with("kv-mib = 64\ndata-mib = 1024\n");
        assert_eq!(with("kv-mib = 32\ndata-mib = 512\n").widening(&approved), None);
        assert_eq!(
            with("kv-mib = 128\ndata-mib = 0\n").widening(&approved).as_deref(),
            Some("limits.kv-mib = 128 (approved 64), limits.data-mib = 0 (unbounded) (approved 1024)")
        );
        assert_eq!(with("data-mib = 1024\n").widening(&with("data-mib = 0\n")), None, "bounding is narrowing");
        assert_eq!(with("pool-size = 16\n").widening(&approved), None, "the provider's own settings");
    }

    #[test]
    fn secrets_are_named_not_given_and_a_new_one_is_the_operators_to_approve() {
        let base = "name = \"p\"\ncomponent = \"p.wasm\"\n[config]\nregion = \"r1\"\n";
        let named = parse(&format!("{base}[secrets]\napi-token = \"prod\"\n")).unwrap();
        assert_eq!(named.secrets, vec![("api-token".to_owned(), "prod".to_owned())]);
        assert!(named.inline_secrets.is_empty() && named.refuse_inline_secrets().is_ok());
        let twice = parse(&format!("{base}[secrets]\nregion = \"prod\"\n")).unwrap_err().to_string();
        assert!(twice.contains("either in [config] or filled in from [secrets]"), "{twice}");
        let walks = parse(&format!("{base}[secrets]\napi-token = \"../../etc/shadow\"\n")).unwrap_err().to_string();
        assert!(walks.contains("must be 1-64"), "{walks}");
        let other = parse(&format!("{base}[secrets]\napi-token = \"other\"\n")).unwrap();
        assert_eq!(other.widening(&named).as_deref(), Some("secrets.api-token = \"other\""));
        assert_eq!(named.widening(&other).as_deref(), Some("secrets.api-token = \"prod\""));
        assert!(named.widening(&named).is_none());
        let plain = parse(base).unwrap();
        assert!(plain.widening(&named).is_none(), "dropping a secret is narrowing");
        let inline = parse(&format!("{base}secret-access-key = \"AbCdEf123456\"\n")).unwrap();
        let refused = inline.refuse_inline_secrets().unwrap_err().to_string();
        assert!(
            refused.contains("config.secret-access-key looks like a secret") && !refused.contains("AbCdEf"),
            "{refused}"
        );
    }

    #[test]
    fn widening_names_what_is_not_approved_and_narrowing_is_none() {
        let approved = parse(
            "name = \"x\"\ncomponent = \"x\"\n[grants]\nkv = true\nprocess = [\"qemu-img\"]\npaths = [\"/img\"]\n",
        )
        .unwrap()
        .grants;
        let with =
            |grants: &str| parse(&format!("name = \"x\"\ncomponent = \"x\"\n[grants]\n{grants}")).unwrap().grants;
        assert_eq!(with("kv = true\n").widening(&approved), None);
        assert_eq!(with("paths = [\"/img/base\"]\n").widening(&approved), None);
        assert_eq!(with("process = [\"sh\"]\n").widening(&approved).as_deref(), Some("process \"sh\""));
        assert_eq!(with("paths = [\"/\"]\n").widening(&approved).as_deref(), Some("paths /"));
        assert_eq!(with("machine-lock = true\n").widening(&approved).as_deref(), Some("machine-lock = true"));
        assert_eq!(with("devices = [\"/dev/kvm\"]\n").widening(&approved).as_deref(), Some("devices /dev/kvm"));
        assert!(with("[grants.http]\nx = \"http://127.0.0.1:1\"\n").widening(&approved).is_some());
        // Several at once are all named: approving one must not hide the others.
        let several =
            with("kv = true\nprocess = [\"sh\"]\nlocal-sockets = true\n[grants.bridge]\ndevices = [\"eth0\"]\n");
        assert_eq!(
            several.widening(&approved).as_deref(),
            Some("process \"sh\", local-sockets = true, [grants.bridge]"),
            "kv was approved"
        );
    }

    /// A room's grant (`local-sockets`) is parsed by its room, among the
    /// built-in fields, with the same errors by line and the same widening check.
    #[test]
    fn a_rooms_grant_is_parsed_compared_and_refused_by_its_room() {
        use broker_capabilities::rooms::local_socket::LocalSocket;
        let with = |grants: &str| parse(&format!("name = \"x\"\ncomponent = \"x\"\n[grants]\n{grants}"));
        let granted = with("kv = true\nlocal-sockets = true\nenv = [\"TZ\"]\nlog = true\n").unwrap().grants;
        assert!(granted.rooms.of::<LocalSocket>());
        assert!(
            granted.rooms.of::<broker_capabilities::rooms::process::Process>().env == ["TZ"]
                && granted.rooms.of::<broker_capabilities::rooms::log::Log>(),
            "keys after a room's are read"
        );
        assert_eq!(granted, with("log = true\nenv = [\"TZ\"]\nkv = true\nlocal-sockets = true\n").unwrap().grants);
        let not = with("kv = true\nlocal-sockets = false\nenv = [\"TZ\"]\nlog = true\n").unwrap().grants;
        assert!(!not.rooms.of::<LocalSocket>());
        assert_eq!(
            not,
            with("env = [\"TZ\"]\nkv = true\nlog = true\n").unwrap().grants,
            "false is the default: no grant"
        );
        assert_ne!(granted, not);
        assert_eq!(granted.widening(&not).as_deref(), Some("local-sockets = true"));
        assert_eq!(not.widening(&granted), None);

        let err = with("kv = true\nlocal-sockets = 3\n").unwrap_err().to_string();
        assert!(err.contains("line 5") && err.contains("boolean"), "{err}");
        let err = with("kv = true\nlocal-sockets = true\nsockets = true\n").unwrap_err().to_string();
        assert!(err.contains("line 6") && err.contains("unknown field `sockets`"), "{err}");
        assert!(err.contains("`local-sockets`"), "the rooms' keys are among those expected: {err}");
    }

    /// A grant spread over several keys (process: `process`, `paths`,
    /// `paths-rw`, `devices`, `env`) is read from all of them, in any order and
    /// between other rooms' keys; a bad value is refused at its own line.
    #[test]
    fn a_grant_spread_over_several_keys_is_read_from_all_of_them() {
        use broker_capabilities::rooms::process::{Process, ProcessGrant};
        let with = |grants: &str| parse(&format!("name = \"x\"\ncomponent = \"x\"\n[grants]\n{grants}"));
        let grants = with(
            "devices = [\"/dev/kvm\"]\nkv = true\nprocess = [\"qemu-img\"]\nenv = [\"TZ\"]\npaths-rw = [\"/srv\"]\n",
        )
        .unwrap()
        .grants;
        let expected = ProcessGrant {
            process: vec!["qemu-img".into()],
            paths: vec![],
            paths_rw: vec!["/srv".into()],
            devices: vec!["/dev/kvm".into()],
            env: vec!["TZ".into()],
        };
        assert_eq!(grants.rooms.of::<Process>(), expected);
        assert!(grants.rooms.of::<broker_capabilities::rooms::kv::Kv>());
        let err = with("process = [\"qemu-img\"]\nkv = true\ndevices = \"/dev/kvm\"\n").unwrap_err().to_string();
        assert!(err.contains("line 6") && err.contains("sequence"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_a_manifest_is_never_quoted() {
        let secret = "root:$6$s3cr3t-hash:19000:0:99999:7:::";
        let cases = [
            (format!("{secret}\ndaemon:*:19000:0:99999:7:::\n"), "not valid TOML (error at line 1, column"),
            (format!("[db]\npassword = \"{secret}\"\n"), "not a provider manifest"),
            // Valid TOML whose keys would be quoted as unknown fields.
            (format!("name = \"x\"\n\"{secret}\" = 1\n"), "not a provider manifest"),
            (format!("component = \"x\"\nname = 1\n\"{secret}\" = 1\n"), "not a provider manifest"),
        ];
        for (text, expected) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
            assert!(!err.contains("s3cr3t") && !err.contains("root") && !err.contains("daemon"), "{err}");
        }
        // A manifest with a syntax error is told where, and not quoted either.
        let err = parse("name = \"x\"\ncomponent = \"x\"\n[grants\nkv = true\n").unwrap_err().to_string();
        assert!(err.contains("not valid TOML (error at line 3, column"), "{err}");
        assert!(!err.contains("[grants"), "{err}");
    }

    /// Fuzzed (bolero, random inputs; `BOLERO_RANDOM_ITERATIONS` for a long
    /// run): any text, and any mutation of a real manifest, parses or is
    /// refused with an error; it never panics.
    #[test]
    fn fuzz_manifest_parse() {
        let real = "name = \"p\"\ncomponent = \"p.wasm\"\n[limits]\nmemory-mib = 64\n[limits.deadlines]\ndefault = \"5s\"\n[grants]\nkv = true\nprocess = [\"/bin/sh\"]\n[config]\na = 1\n";
        let tokens = [
            "name = ",
            "component = ",
            "sha256 = ",
            "isolation = ",
            "\n[limits]\n",
            "\n[limits.deadlines]\n",
            "\n[grants]\n",
            "\n[grants.http]\n",
            "\n[grants.bridge]\n",
            "\n[config]\n",
            "memory-mib = ",
            "data-mib = ",
            "kv-mib = ",
            "max-records = ",
            "queue-wait = ",
            "default = ",
            "kv = true",
            "process = ",
            "\"",
            "[",
            "]",
            "{",
            "}",
            "\"5s\"",
            "18446744073709551615",
            "-1",
            "0",
            "\"p\"",
            "\"../x\"",
        ];
        bolero::check!().with_iterations(20_000).with_type::<(Vec<u8>, u16, Vec<u8>)>().for_each(
            |(made, at, inserted)| {
                let _ = Manifest::parse(Path::new("/m/p.toml"), &crate::fuzz_text::of(made, "az09 =.\n\"", &tokens));
                // A real manifest with text put in: past the syntax, into the checks.
                let at = usize::from(*at) % real.len();
                let inserted = crate::fuzz_text::of(inserted, "az09 =.\n\"", &tokens);
                let text = format!("{}{inserted}{}", &real[..at], &real[at..]);
                let _ = Manifest::parse(Path::new("/m/p.toml"), &text);
            },
        );
    }

    /// A component that is a FIFO or a device is refused at once, not read.
    #[test]
    fn a_component_is_read_only_from_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.wasm");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        for (component, expected) in [(fifo.as_path(), "a FIFO"), (Path::new("/dev/zero"), "a device")] {
            let text = format!("name = \"x\"\ncomponent = \"{}\"\n", component.display());
            let manifest = Manifest::parse(&dir.path().join("x.toml"), &text).unwrap();
            let err = manifest.read_component().unwrap_err().to_string();
            assert!(err.contains(&format!("not a regular file ({expected})")), "{err}");
        }
        let big = dir.path().join("big.wasm");
        std::fs::File::create(&big).unwrap().set_len(MAX_COMPONENT_BYTES + 1).unwrap();
        let err = read_regular_file(&big, MAX_COMPONENT_BYTES).unwrap_err().to_string();
        assert!(err.contains("larger than 67108864 bytes"), "{err}");
    }

    #[test]
    fn only_a_regular_file_of_bounded_size_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.toml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let big = dir.path().join("big.toml");
        std::fs::write(&big, format!("name = \"x\"\ncomponent = \"x\"\n#{}\n", "x".repeat(1 << 20))).unwrap();
        let binary = dir.path().join("binary.toml");
        std::fs::write(&binary, b"name = \"\xff\xfe secret\"\n").unwrap();
        let cases = [
            (fifo.as_path(), "not a regular file (a FIFO)"),
            (Path::new("/dev/zero"), "not a regular file (a device)"),
            (dir.path(), "not a regular file (a directory)"),
            (big.as_path(), "larger than 1048576 bytes"),
            (binary.as_path(), "not UTF-8 text"),
        ];
        for (path, expected) in cases {
            // A FIFO with no writer would block an open for reading: this returns at once.
            let err = Manifest::load(path).unwrap_err().to_string();
            assert!(err.contains(&format!("cannot read manifest {}: {expected}", path.display())), "{err}");
            assert!(!err.contains("secret"), "{err}");
        }
        let passwd = dir.path().join("passwd");
        std::fs::write(&passwd, "root:x:0:0:root:/root:/bin/bash\nsecret-user:x:1000:1000::/home/s:/bin/sh\n").unwrap();
        let err = Manifest::load(&passwd).unwrap_err().to_string().replace(&passwd.display().to_string(), "PASSWD");
        assert!(err.starts_with("invalid manifest PASSWD: not valid TOML"), "{err}");
        assert!(!err.contains("root") && !err.contains("secret") && !err.contains("/bin"), "{err}");
    }

    #[test]
    fn bad_values_are_named() {
        let bad_duration = parse("name = \"x\"\ncomponent = \"x\"\n[limits.deadlines]\ndefault = \"soon\"\n");
        assert!(bad_duration.unwrap_err().to_string().contains("soon"));
        let bad_name = parse("name = \"Bad Name\"\ncomponent = \"x\"\n");
        assert!(bad_name.unwrap_err().to_string().contains("Bad Name"));
        let bad_pin = parse("name = \"x\"\ncomponent = \"x\"\nsha256 = \"abc\"\n");
        assert!(bad_pin.unwrap_err().to_string().contains("64 hex"));
    }
}
