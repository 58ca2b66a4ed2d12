//! Secrets the host keeps for a provider: values read from files only the
//! host's user may read, handed to the guest in its config, and redacted
//! from everything the host shows.
//!
//! A manifest names them under `[secrets]`, a config key to a secret name:
//!
//! ```toml
//! [secrets]
//! api-token = "prod"          # DATA_DIR/secrets/<provider>/prod: 0600, the host's user's
//! ```
//!
//! The guest sees `"api-token": "<the file's text>"` in its `provider-config()`
//! (the file's one trailing newline left off). The manifest, the store,
//! `provider show` and the API hold only the name. Whatever text the guest
//! hands back to be shown — its log lines and output, its error messages,
//! its status data — has each secret's value replaced by `<secret NAME>`,
//! and so have the conformance kit's reports and recordings. A value cut up
//! or encoded by the guest is not recognised: redaction is for mistakes, the
//! grant is what limits a hostile provider.
//!
//! A provider's secrets are in a dir of its own, named after it: a manifest
//! can name only secrets the operator put there for that provider.
//!
//! Files are opened beneath the dir without following a link, refused unless
//! regular, owned by the host's user and readable by no one else
//! ([`open_private`], shared with the signing credentials), and read again
//! when they change.

use rustix::fs::{Mode, OFlags, ResolveFlags};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Where under `DATA_DIR` the operator keeps secrets.
pub const SECRETS_DIR: &str = "secrets";

/// The largest secret read.
pub(crate) const MAX_SECRET_BYTES: u64 = 64 << 10;

/// The shortest secret taken: anything shorter could not be told from
/// ordinary text, so it could not be redacted.
pub(crate) const MIN_SECRET_BYTES: usize = 8;

/// Most secrets one manifest may name.
pub const MAX_SECRETS: usize = 32;

/// Why a file that should be the host's alone was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrivateFileError {
    /// No file by that name.
    #[error("no such file: write it (0600, the host's user's)")]
    Missing,
    /// A link where the file should be.
    #[error("it is a link: refused")]
    Link,
    /// A directory, FIFO, device or socket.
    #[error("not a regular file")]
    NotRegular,
    /// Owned by another user.
    #[error("owned by uid {uid}, not by the host's user: refused")]
    Owner {
        /// Its owner.
        uid: u32,
    },
    /// Others may read or write it.
    #[error("mode {mode:o} lets others read or write it: refused (chmod 600 {})", path.display())]
    Mode {
        /// Its permission bits.
        mode: u32,
        /// The file.
        path: PathBuf,
    },
    /// Larger than its reader takes.
    #[error("larger than {max} bytes")]
    TooLarge {
        /// The bound.
        max: u64,
    },
    /// The dir or the file could not be opened or read.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What identifies a file's version: a changed one is read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileVersion {
    dev: u64,
    ino: u64,
    size: i64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// A file of the operator's that only the host's user may read.
pub(crate) struct PrivateFile {
    fd: OwnedFd,
    /// Its version, to tell whether a cached reading is still good.
    pub version: FileVersion,
}

impl PrivateFile {
    /// Its content, at most `max` bytes (checked before opening too).
    pub(crate) fn read(self, max: u64) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        std::fs::File::from(self.fd).take(max + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > max {
            return Err(std::io::Error::other(format!("larger than {max} bytes")));
        }
        Ok(bytes)
    }
}

/// Open `dir/name` for reading: beneath `dir`, never through a link, and
/// only a regular file of at most `max` bytes, owned by the host's user and
/// neither readable nor writable by anyone else.
pub(crate) fn open_private(dir: &Path, name: &str, max: u64) -> Result<PrivateFile, PrivateFileError> {
    let root = rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).map_err(
        |e| match e {
            rustix::io::Errno::NOENT => PrivateFileError::Missing,
            e => std::io::Error::other(format!("the dir {}: {e}", dir.display())).into(),
        },
    )?;
    let how = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let fd = rustix::fs::openat2(&root, name, how, Mode::empty(), resolve).map_err(|e| match e {
        rustix::io::Errno::NOENT => PrivateFileError::Missing,
        rustix::io::Errno::LOOP | rustix::io::Errno::XDEV => PrivateFileError::Link,
        e => PrivateFileError::Io(e.into()),
    })?;
    let stat = rustix::fs::fstat(fd.as_fd()).map_err(std::io::Error::from)?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(PrivateFileError::NotRegular);
    }
    if stat.st_uid != rustix::process::geteuid().as_raw() {
        return Err(PrivateFileError::Owner { uid: stat.st_uid });
    }
    if stat.st_mode & 0o077 != 0 {
        return Err(PrivateFileError::Mode { mode: stat.st_mode & 0o777, path: dir.join(name) });
    }
    if stat.st_size as u64 > max {
        return Err(PrivateFileError::TooLarge { max });
    }
    let version = FileVersion {
        dev: stat.st_dev,
        ino: stat.st_ino,
        size: stat.st_size,
        mtime: (stat.st_mtime, stat.st_mtime_nsec as i64),
        ctime: (stat.st_ctime, stat.st_ctime_nsec as i64),
    };
    Ok(PrivateFile { fd, version })
}

/// A secret's or a credential's name: what its file is called, and nothing that walks.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
        && !name.starts_with('-');
    if ok { Ok(()) } else { Err(format!("{what} name {name:?} must be 1-64 letters, digits, '-' or '_'")) }
}

/// Why a secret could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The host keeps no secrets here (a bare runtime).
    #[error("secret {name:?}: this host keeps no secrets (only the daemon's DATA_DIR/{SECRETS_DIR}/PROVIDER does)")]
    NoSecretsDir {
        /// As the manifest names it.
        name: String,
    },
    /// Its file is missing, unsafe or unusable.
    #[error("secret {name:?} ({path}): {reason}")]
    File {
        /// As the manifest names it.
        name: String,
        /// Where the host looked.
        path: PathBuf,
        /// What was wrong; never the value.
        reason: String,
    },
}

/// A secret's value; `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<str>);

impl Secret {
    /// The value, for the one place it goes.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

/// `DATA_DIR/secrets`: the secrets manifests name, one dir per provider, read as they change.
#[derive(Debug)]
pub struct SecretsDir {
    dir: PathBuf,
    cache: Mutex<HashMap<(String, String), (FileVersion, Secret)>>,
}

impl SecretsDir {
    /// The secrets under `dir` (`DATA_DIR/secrets`).
    pub fn new(dir: PathBuf) -> SecretsDir {
        SecretsDir { dir, cache: Mutex::default() }
    }

    /// `provider`'s secret called `name`, read again if its file changed.
    pub fn get(&self, provider: &str, name: &str) -> Result<Secret, SecretError> {
        let dir = self.dir.join(provider);
        let path = dir.join(name);
        let refuse = |reason: String| SecretError::File { name: name.to_owned(), path: path.clone(), reason };
        check_name("secret", name).map_err(refuse)?;
        let file = open_private(&dir, name, MAX_SECRET_BYTES).map_err(|e| refuse(e.to_string()))?;
        let key = (provider.to_owned(), name.to_owned());
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, secret)) = cache.get(&key)
            && *seen == file.version
        {
            return Ok(secret.clone());
        }
        let version = file.version;
        let bytes = file.read(MAX_SECRET_BYTES).map_err(|e| refuse(e.to_string()))?;
        let mut text = String::from_utf8(bytes).map_err(|_| refuse("not UTF-8 text".into()))?;
        // The one newline an editor or `echo` leaves is not part of it.
        if text.ends_with('\n') {
            text.pop();
            if text.ends_with('\r') {
                text.pop();
            }
        }
        if text.len() < MIN_SECRET_BYTES {
            return Err(refuse(format!(
                "shorter than {MIN_SECRET_BYTES} bytes: so short a value could not be told from other text to be hidden"
            )));
        }
        let secret = Secret(text.into());
        cache.insert(key, (version, secret.clone()));
        Ok(secret)
    }
}

/// Where a provider's secrets come from.
#[derive(Debug, Clone, Default)]
pub enum SecretSource {
    /// None here: a manifest naming a secret does not load.
    #[default]
    None,
    /// The operator's files (`DATA_DIR/secrets`).
    Dir(Arc<SecretsDir>),
    /// Stand-ins (`kit-secret:NAME`): the conformance kit's scripted sandbox,
    /// whose recorded scripts hold them in the real values' place.
    Placeholders,
    /// The operator's files, for the kit's recording: hidden as their
    /// stand-ins, so a recorded script replays against a scripted run.
    Recording(Arc<SecretsDir>),
}

impl SecretSource {
    /// The secrets under `dir`.
    pub fn dir(dir: PathBuf) -> SecretSource {
        SecretSource::Dir(Arc::new(SecretsDir::new(dir)))
    }

    fn get(&self, provider: &str, name: &str) -> Result<Secret, SecretError> {
        match self {
            SecretSource::None => Err(SecretError::NoSecretsDir { name: name.to_owned() }),
            SecretSource::Dir(dir) | SecretSource::Recording(dir) => dir.get(provider, name),
            SecretSource::Placeholders => Ok(Secret(placeholder(name).into())),
        }
    }
}

/// What stands in for a secret in the kit's scripted sandbox and its recordings.
pub(crate) fn placeholder(name: &str) -> String {
    format!("kit-secret:{name}")
}

/// Replaces the values of a provider's secrets in text the host shows.
#[derive(Default)]
pub struct Redactor {
    any: AtomicBool,
    /// `(value, what is shown instead)`, longest value first.
    values: RwLock<Vec<(Arc<str>, String)>>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redactor").field("values", &self.read().len()).finish()
    }
}

impl Redactor {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<(Arc<str>, String)>> {
        self.values.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Hide these values from now on, each shown as its label.
    pub fn set(&self, mut values: Vec<(Arc<str>, String)>) {
        values.retain(|(value, _)| !value.is_empty());
        // A value inside another is replaced after it.
        values.sort_by_key(|value| std::cmp::Reverse(value.0.len()));
        self.any.store(!values.is_empty(), Ordering::Release);
        *self.values.write().unwrap_or_else(|p| p.into_inner()) = values;
    }

    /// Whether there is anything to hide.
    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    /// `text` with every secret value replaced by its label.
    pub fn redact<'a>(&self, text: &'a str) -> Cow<'a, str> {
        if self.is_empty() {
            return Cow::Borrowed(text);
        }
        let values = self.read();
        let mut text = Cow::Borrowed(text);
        for (value, label) in values.iter() {
            if text.contains(&**value) {
                text = Cow::Owned(text.replace(&**value, label));
            }
        }
        text
    }

    /// Redact in place.
    pub fn redact_string(&self, text: &mut String) {
        if let Cow::Owned(redacted) = self.redact(text) {
            *text = redacted;
        }
    }

    /// Every string in `value`, keys included, redacted.
    pub fn redact_json(&self, value: &mut serde_json::Value) {
        if self.is_empty() {
            return;
        }
        match value {
            serde_json::Value::String(text) => self.redact_string(text),
            serde_json::Value::Array(items) => items.iter_mut().for_each(|item| self.redact_json(item)),
            serde_json::Value::Object(map) => {
                let entries = std::mem::take(map);
                for (mut key, mut item) in entries {
                    self.redact_string(&mut key);
                    self.redact_json(&mut item);
                    map.insert(key, item);
                }
            }
            _ => {}
        }
    }
}

/// Words in a config key that say its value is a secret.
const SECRET_WORDS: [&str; 8] =
    ["secret", "password", "passwd", "token", "private-key", "api-key", "apikey", "credential"];

/// Whether a config key names a secret (`secret-access-key`, `api_token`, `DB_PASSWORD`).
pub fn looks_secret(key: &str) -> bool {
    let key = key.to_ascii_lowercase().replace('_', "-");
    SECRET_WORDS.iter().any(|word| key.contains(word))
}

/// The dotted paths of string values in `config` whose keys name a secret:
/// secrets given inline, which the store would keep and `provider show` print.
pub fn inline_secrets(config: &toml::Table) -> Vec<String> {
    inline_secret_values(config).into_iter().map(|(path, _)| path).collect()
}

/// As [`inline_secrets`], each with its value.
fn inline_secret_values(config: &toml::Table) -> Vec<(String, &str)> {
    fn walk<'a>(value: &'a toml::Value, path: &str, found: &mut Vec<(String, &'a str)>, secret_key: bool) {
        match value {
            toml::Value::String(text) if secret_key && !text.is_empty() => found.push((path.to_owned(), text)),
            // Under a key that says secret, every string is one (`[config.passwords]`).
            toml::Value::Table(table) => {
                for (key, value) in table {
                    walk(value, &format!("{path}.{key}"), found, secret_key || looks_secret(key));
                }
            }
            toml::Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, &format!("{path}[{i}]"), found, secret_key);
                }
            }
            _ => {}
        }
    }
    let mut found = Vec::new();
    for (key, value) in config {
        walk(value, key, &mut found, looks_secret(key));
    }
    found
}

/// Most values one provider version's redactor keeps hiding after rotations.
const MAX_HELD_VALUES: usize = 64;

/// A secret value as it appears raw and in the forms text the host shows
/// carries it: JSON-escaped (a config, a report), Rust-escaped (the kit's
/// traces), form- and percent-encoded (a recorded request), and each line of a
/// value of several (a guest's output is taken line by line).
fn encoded_forms(value: &Arc<str>) -> Vec<Arc<str>> {
    let mut forms: Vec<Arc<str>> = vec![value.clone()];
    let quoted = |text: String| text.get(1..text.len().saturating_sub(1)).unwrap_or_default().to_owned();
    let json = quoted(serde_json::Value::String(value.to_string()).to_string());
    let debug = quoted(format!("{value:?}"));
    let debug_of_json = quoted(format!("{json:?}"));
    let form: String = form_urlencoded::byte_serialize(value.as_bytes()).collect();
    let percent = form.replace('+', "%20");
    let lines = value.lines().filter(|line| line.len() >= MIN_SECRET_BYTES).map(str::to_owned);
    for form in [json, debug, debug_of_json, form, percent].into_iter().chain(lines) {
        if form.len() >= MIN_SECRET_BYTES && !forms.iter().any(|f| **f == *form) {
            forms.push(form.into());
        }
    }
    forms
}

/// What [`ProviderConfig`] last read.
#[derive(Default)]
struct Current {
    values: Vec<Secret>,
    json: Arc<str>,
    /// Every value this version handed out (each with its label), oldest first.
    held: Vec<(Arc<str>, String)>,
    /// A read failed and was said: not said again until one succeeds.
    went_bad: bool,
}

/// A manifest's text with its inline secret-looking `[config]` values (as
/// [`inline_secrets`] finds them) replaced by `<redacted>`.
pub fn hide_inline_in_manifest(text: &str) -> String {
    let Ok(manifest) = toml::from_str::<toml::Table>(text) else { return text.to_owned() };
    let Some(toml::Value::Table(config)) = manifest.get("config") else { return text.to_owned() };
    let mut shown = text.to_owned();
    for (_, value) in inline_secret_values(config) {
        // In a basic string (escaped as JSON escapes `"` and `\`), and as given (a literal string).
        let escaped = serde_json::Value::String(value.to_owned()).to_string();
        let escaped = escaped.get(1..escaped.len().saturating_sub(1)).unwrap_or_default().to_owned();
        // Quoted, whatever its length; bare too once long enough not to be other text.
        shown = shown.replace(&format!("\"{escaped}\""), "\"<redacted>\"");
        shown = shown.replace(&format!("'{value}'"), "'<redacted>'");
        if value.len() >= MIN_SECRET_BYTES {
            shown = shown.replace(&escaped, "<redacted>").replace(value, "<redacted>");
        }
    }
    shown
}

/// A provider's config as its guest gets it: the manifest's `[config]` with
/// its `[secrets]` filled in from their source, read again as they change;
/// and the redactor for everything of it the host shows.
pub struct ProviderConfig {
    provider: Arc<str>,
    public: serde_json::Map<String, serde_json::Value>,
    secrets: Vec<(String, String)>,
    source: SecretSource,
    /// The values last read, and the guest's config made of them.
    current: Mutex<Current>,
    /// Inline values that look secret (kept from a manifest approved before they were refused).
    inline: Vec<Arc<str>>,
    redactor: Arc<Redactor>,
}

impl std::fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderConfig").field("provider", &self.provider).field("secrets", &self.secrets).finish()
    }
}

impl ProviderConfig {
    /// `config` (the manifest's `[config]`) with `secrets` (`[secrets]`: key → name)
    /// read from `source`; an error names the first secret that could not be had.
    pub fn load(
        provider: &str,
        config: &toml::Table,
        secrets: &[(String, String)],
        source: SecretSource,
    ) -> Result<ProviderConfig, SecretError> {
        let public = match serde_json::to_value(config) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        let values = secrets.iter().map(|(_, name)| source.get(provider, name)).collect::<Result<Vec<_>, _>>()?;
        let inline = inline_secret_values(config).into_iter().map(|(_, value)| Arc::from(value)).collect();
        let loaded = ProviderConfig {
            provider: provider.into(),
            public,
            secrets: secrets.to_vec(),
            source,
            current: Mutex::default(),
            inline,
            redactor: Arc::default(),
        };
        loaded.take_locked(&mut loaded.current.lock().unwrap_or_else(|p| p.into_inner()), values);
        Ok(loaded)
    }

    /// A config without secrets (tests, benchmarks).
    pub fn plain(provider: &str, config: &toml::Table) -> ProviderConfig {
        ProviderConfig::load(provider, config, &[], SecretSource::None).unwrap_or_else(|_| unreachable!())
    }

    /// Take `values` as the secrets' current ones (under `current`'s lock,
    /// held by the caller): the guest's config made of them, and the redactor
    /// hiding them and every value this version held before (a call begun
    /// before a rotation still has the old one).
    fn take_locked(&self, current: &mut Current, values: Vec<Secret>) {
        let mut config = self.public.clone();
        for ((key, _), value) in self.secrets.iter().zip(&values) {
            config.insert(key.clone(), serde_json::Value::String(value.expose().to_owned()));
        }
        let json: Arc<str> = serde_json::Value::Object(config).to_string().into();
        let label = |name: &str| match self.source {
            SecretSource::Placeholders | SecretSource::Recording(_) => placeholder(name),
            _ => format!("<secret {name}>"),
        };
        for ((_, name), value) in self.secrets.iter().zip(&values) {
            if !current.held.iter().any(|(held, _)| **held == *value.expose()) {
                current.held.push((value.0.clone(), label(name)));
            }
        }
        // Bounded: the oldest go first (a secret rotated this often is read from a file being written).
        let excess = current.held.len().saturating_sub(MAX_HELD_VALUES.max(self.secrets.len()));
        current.held.drain(..excess);
        let mut hidden: Vec<(Arc<str>, String)> = Vec::new();
        let inline = (self.inline.iter())
            .filter(|value| value.len() >= MIN_SECRET_BYTES)
            .map(|value| (value.clone(), "<redacted>".to_owned()));
        for (value, label) in current.held.iter().cloned().chain(inline) {
            for form in encoded_forms(&value) {
                hidden.push((form, label.clone()));
            }
        }
        self.redactor.set(hidden);
        current.values = values;
        current.json = json;
    }

    /// The config as JSON, as the guest gets it: secrets read again if their
    /// files changed (a file that went bad keeps the last good value, said once).
    pub fn for_guest(&self) -> Arc<str> {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if !self.secrets.is_empty() && matches!(self.source, SecretSource::Dir(_) | SecretSource::Recording(_)) {
            let fresh: Result<Vec<Secret>, SecretError> =
                self.secrets.iter().map(|(_, name)| self.source.get(&self.provider, name)).collect();
            match fresh {
                Ok(values) => {
                    current.went_bad = false;
                    if current.values != values {
                        self.take_locked(&mut current, values);
                    }
                }
                Err(error) if !current.went_bad => {
                    current.went_bad = true;
                    tracing::warn!(provider = &*self.provider, %error, "a secret went bad: its last good value is used");
                }
                Err(_) => {}
            }
        }
        current.json.clone()
    }

    /// What hides the secrets' values in text the host shows.
    pub fn redactor(&self) -> &Arc<Redactor> {
        &self.redactor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn private(path: &Path, text: &str) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    #[test]
    fn a_secret_file_must_be_the_hosts_alone_and_is_read_again_when_changed() {
        let root = tempfile::tempdir().unwrap();
        let secrets = SecretsDir::new(root.path().to_owned());
        let dir = root.path().join("p");
        std::fs::create_dir(&dir).unwrap();
        let get = |name: &str| secrets.get("p", name);
        assert!(get("token").unwrap_err().to_string().contains("no such file"));
        let path = dir.join("token");
        private(&path, "s3cr3t-value-one\n");
        assert_eq!(get("token").unwrap().expose(), "s3cr3t-value-one");
        assert!(!format!("{:?}", get("token").unwrap()).contains("s3cr3t"));
        private(&path, "s3cr3t-value-two-longer\r\n");
        assert_eq!(get("token").unwrap().expose(), "s3cr3t-value-two-longer");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let open = get("token").unwrap_err().to_string();
        assert!(open.contains("chmod 600") && !open.contains("s3cr3t"), "{open}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        private(&dir.join("short"), "abc\n");
        assert!(get("short").unwrap_err().to_string().contains("shorter than 8"));
        std::os::unix::fs::symlink(&path, dir.join("linked")).unwrap();
        assert!(get("linked").unwrap_err().to_string().contains("link"));
        std::fs::create_dir(dir.join("sub")).unwrap();
        assert!(get("sub").unwrap_err().to_string().contains("not a regular file"));
        assert!(get("../token").unwrap_err().to_string().contains("must be 1-64"));
        let fifo = dir.join("fifo");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        assert!(get("fifo").unwrap_err().to_string().contains("not a regular file"), "never blocks");
        std::fs::write(dir.join("big"), vec![b'x'; MAX_SECRET_BYTES as usize + 1]).unwrap();
        std::fs::set_permissions(dir.join("big"), std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(get("big").unwrap_err().to_string().contains("larger than"));
    }

    #[test]
    fn the_guest_gets_the_value_and_the_redactor_hides_it_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("p")).unwrap();
        private(&dir.path().join("p/prod"), "tok-AAAA-1111\n");
        let config: toml::Table = toml::from_str("zones = [\"a\"]\n").unwrap();
        let secrets = vec![("api-token".to_owned(), "prod".to_owned())];
        let source = SecretSource::dir(dir.path().to_owned());
        let loaded = ProviderConfig::load("p", &config, &secrets, source).unwrap();
        let json: serde_json::Value = serde_json::from_str(&loaded.for_guest()).unwrap();
        assert_eq!(json, serde_json::json!({"zones": ["a"], "api-token": "tok-AAAA-1111"}));
        let redactor = loaded.redactor().clone();
        assert_eq!(
            redactor.redact("said tok-AAAA-1111 twice: tok-AAAA-1111"),
            "said <secret prod> twice: <secret prod>"
        );
        private(&dir.path().join("p/prod"), "tok-BBBB-2222-rotated\n");
        assert!(loaded.for_guest().contains("tok-BBBB-2222-rotated"));
        assert_eq!(redactor.redact("tok-BBBB-2222-rotated"), "<secret prod>", "the same redactor, updated");
        // A file gone bad: the last good value stays.
        std::fs::remove_file(dir.path().join("p/prod")).unwrap();
        assert!(loaded.for_guest().contains("tok-BBBB-2222-rotated"));
        // With no source, a manifest naming a secret does not load; the kit's stand-ins do.
        let none = ProviderConfig::load("p", &config, &secrets, SecretSource::None).unwrap_err();
        assert!(none.to_string().contains("keeps no secrets"), "{none}");
        let kit = ProviderConfig::load("p", &config, &secrets, SecretSource::Placeholders).unwrap();
        assert!(kit.for_guest().contains("\"api-token\":\"kit-secret:prod\""));
        let mut report = serde_json::json!({"trace": ["config kit-secret:prod"], "kit-secret:prod": 1});
        kit.redactor().redact_json(&mut report);
        assert_eq!(report, serde_json::json!({"trace": ["config kit-secret:prod"], "kit-secret:prod": 1}));
        let mut report = serde_json::json!({"trace": ["config tok-BBBB-2222-rotated"]});
        redactor.redact_json(&mut report);
        assert_eq!(report, serde_json::json!({"trace": ["config <secret prod>"]}));
    }

    #[test]
    fn inline_secrets_are_found_at_any_depth_and_hidden() {
        let config: toml::Table = toml::from_str(
            "region = \"r1\"\nsecret-access-key = \"inline-s3cr3t-1\"\n[db]\nDB_PASSWORD = \"hunter2-but-long\"\n\
             user = \"u\"\n[[hosts]]\napi_token = \"\"\nname = \"token-looking-name\"\n\
             [passwords]\ndb = \"nested-under-a-secret-key\"\n",
        )
        .unwrap();
        assert_eq!(
            inline_secrets(&config),
            vec!["db.DB_PASSWORD".to_owned(), "passwords.db".to_owned(), "secret-access-key".to_owned()]
        );
        let loaded = ProviderConfig::plain("p", &config);
        assert_eq!(loaded.redactor().redact("x inline-s3cr3t-1 hunter2-but-long r1"), "x <redacted> <redacted> r1");
        assert!(!looks_secret("region") && looks_secret("Api_Key") && looks_secret("bearer-token"));
    }

    #[test]
    fn a_secret_is_hidden_escaped_encoded_line_by_line_and_after_a_rotation() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("p")).unwrap();
        let pem = "-----BEGIN KEY-----\nMIIEvAIBADANBgkqhkiG9w0B\nAQEFAASCBKYwggSiAgEAAoIB\n-----END KEY-----";
        private(&dir.path().join("p/key"), pem);
        let secrets = vec![("key".to_owned(), "key".to_owned())];
        let loaded = ProviderConfig::load("p", &toml::Table::new(), &secrets, SecretSource::dir(dir.path().into()));
        let loaded = loaded.unwrap();
        let redactor = loaded.redactor().clone();
        let config = loaded.for_guest();
        for shown in [
            config.to_string(),
            format!("{config:?}"),
            format!("x={}", form_urlencoded::byte_serialize(pem.as_bytes()).collect::<String>()),
            "stdout: MIIEvAIBADANBgkqhkiG9w0B".to_owned(),
        ] {
            let hidden = redactor.redact(&shown);
            assert!(!hidden.contains("MIIEvAIBADANBgkqhkiG9w0B"), "{shown} -> {hidden}");
            assert!(hidden.contains("<secret key>"), "{hidden}");
        }
        private(&dir.path().join("p/key"), "rotated-value-0001");
        assert!(loaded.for_guest().contains("rotated-value-0001"));
        assert_eq!(redactor.redact("MIIEvAIBADANBgkqhkiG9w0B rotated-value-0001"), "<secret key> <secret key>");
    }

    #[test]
    fn an_approved_manifests_inline_secrets_are_hidden_in_its_text() {
        let text = "name = \"p\"\n[config]\nregion = \"r1\"\napi_token = 'lit-s3cr3t-\\x'\n[config.db]\n\
                    password = \"esc-s3cr3t-\\\"q\\\"\"\n";
        let shown = hide_inline_in_manifest(text);
        assert!(!shown.contains("s3cr3t") && shown.contains("region = \"r1\""), "{shown}");
        assert_eq!(hide_inline_in_manifest("not toml ["), "not toml [");
        // A short one only where it is a whole string: never inside other text.
        let short = hide_inline_in_manifest("component = \"pad.wasm\"\n[config]\npassword = \"pa\"\n");
        assert_eq!(short, "component = \"pad.wasm\"\n[config]\npassword = \"<redacted>\"\n");
    }

    #[test]
    fn a_value_inside_another_is_hidden_whole() {
        let redactor = Redactor::default();
        redactor.set(vec![("abcdefgh".into(), "<a>".into()), ("abcdefgh-longer".into(), "<b>".into())]);
        assert_eq!(redactor.redact("abcdefgh-longer abcdefgh"), "<b> <a>");
        assert!(matches!(Redactor::default().redact("anything"), Cow::Borrowed(_)));
    }
}
