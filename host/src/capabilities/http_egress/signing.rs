//! Signing by the host: a grant that says `sign = "aws-sigv4"` has its
//! requests signed here, with a credential the guest never sees, after the
//! grant's rules passed ([`super::rules`]).
//!
//! Credentials live in `DATA_DIR/credentials/<name>.toml`, written by the
//! operator: refused unless a regular file owned by the host's user and
//! readable by no one else (opened without following a link), read again
//! when it changes. The file may instead say `source = "environment"`: the
//! host's own `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
//! `AWS_SESSION_TOKEN`. The secret is held in [`Credentials`], whose `Debug`
//! hides it, and goes nowhere but into the signature.

use aws_credential_types::Credentials;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::Deserialize;
use std::collections::HashMap;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Mutex;

/// Where under `DATA_DIR` the operator keeps credentials.
pub const CREDENTIALS_DIR: &str = "credentials";

/// The largest credentials file read.
const MAX_FILE: u64 = 64 << 10;

/// Why a request could not be signed; nothing was sent.
#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    /// The host has no credentials dir here (the conformance kit, a bare runtime).
    #[error("credentials {name:?}: this host keeps no credentials (only the daemon's store does)")]
    NoCredentialsDir {
        /// As the grant names it.
        name: String,
    },
    /// The credentials file is missing, unsafe or malformed.
    #[error("credentials {name:?} ({path}): {reason}")]
    Credentials {
        /// As the grant names it.
        name: String,
        /// Where the host looked.
        path: PathBuf,
        /// What was wrong; never the secret.
        reason: String,
    },
    /// The signer refused the request (a URI it cannot canonicalise, …).
    #[error("cannot sign the request: {0}")]
    Sign(String),
}

/// `<name>.toml`, as the operator writes it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct CredentialsFile {
    /// `"file"` (the default: the keys below) or `"environment"`.
    #[serde(default)]
    source: Option<String>,
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    session_token: Option<String>,
}

/// What identifies a file's version: a changed one is read again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Version {
    dev: u64,
    ino: u64,
    size: i64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// `DATA_DIR/credentials`: the credentials grants name, read as they change.
#[derive(Debug)]
pub struct CredentialsDir {
    dir: PathBuf,
    cache: Mutex<HashMap<String, (Version, Credentials)>>,
}

/// A credentials name: what the file is called, and nothing that walks.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
        && !name.starts_with('-');
    if ok { Ok(()) } else { Err(format!("credentials name {name:?} must be 1-64 letters, digits, '-' or '_'")) }
}

impl CredentialsDir {
    /// The credentials under `dir` (`DATA_DIR/credentials`).
    pub fn new(dir: PathBuf) -> CredentialsDir {
        CredentialsDir { dir, cache: Mutex::default() }
    }

    /// The credentials called `name`, read again if its file changed.
    pub fn get(&self, name: &str) -> Result<Credentials, SigningError> {
        let path = self.dir.join(format!("{name}.toml"));
        let refuse = |reason: String| SigningError::Credentials { name: name.to_owned(), path: path.clone(), reason };
        check_name(name).map_err(refuse)?;
        let dir = rustix::fs::open(&self.dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| refuse(format!("the credentials dir {}: {e}", self.dir.display())))?;
        let how = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY;
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        let file =
            rustix::fs::openat2(&dir, format!("{name}.toml"), how, Mode::empty(), resolve).map_err(|e| match e {
                rustix::io::Errno::NOENT => refuse("no such file: write it (0600, the host's user's)".into()),
                rustix::io::Errno::LOOP | rustix::io::Errno::XDEV => refuse("it is a link: refused".into()),
                e => refuse(e.to_string()),
            })?;
        let stat = rustix::fs::fstat(file.as_fd()).map_err(|e| refuse(e.to_string()))?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(refuse("not a regular file".into()));
        }
        if stat.st_uid != rustix::process::geteuid().as_raw() {
            return Err(refuse(format!("owned by uid {}, not by the host's user: refused", stat.st_uid)));
        }
        if stat.st_mode & 0o077 != 0 {
            return Err(refuse(format!(
                "mode {:o} lets others read or write it: refused (chmod 600 {})",
                stat.st_mode & 0o777,
                path.display()
            )));
        }
        if stat.st_size as u64 > MAX_FILE {
            return Err(refuse(format!("larger than {MAX_FILE} bytes")));
        }
        let version = Version {
            dev: stat.st_dev,
            ino: stat.st_ino,
            size: stat.st_size,
            mtime: (stat.st_mtime, stat.st_mtime_nsec as i64),
            ctime: (stat.st_ctime, stat.st_ctime_nsec as i64),
        };
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, credentials)) = cache.get(name)
            && *seen == version
        {
            return Ok(credentials.clone());
        }
        let mut text = String::new();
        std::fs::File::from(file).take(MAX_FILE).read_to_string(&mut text).map_err(|e| refuse(e.to_string()))?;
        // The parser's message could quote the line it failed on: the secret's, perhaps.
        let parsed: CredentialsFile = toml::from_str(&text).map_err(|e| {
            refuse(format!(
                "not valid: {} (keys: access-key-id, secret-access-key, session-token, or source = \"environment\")",
                e.message()
            ))
        })?;
        let credentials = from_file(parsed).map_err(refuse)?;
        cache.insert(name.to_owned(), (version, credentials.clone()));
        Ok(credentials)
    }
}

fn from_file(file: CredentialsFile) -> Result<Credentials, String> {
    match file.source.as_deref() {
        None | Some("file") => {
            let (Some(key), Some(secret)) = (file.access_key_id, file.secret_access_key) else {
                return Err("needs access-key-id and secret-access-key".into());
            };
            if key.is_empty() || secret.is_empty() {
                return Err("access-key-id and secret-access-key must not be empty".into());
            }
            Ok(Credentials::new(key, secret, file.session_token, None, "wasm-broker credentials file"))
        }
        Some("environment") => {
            if file.access_key_id.is_some() || file.secret_access_key.is_some() || file.session_token.is_some() {
                return Err("source = \"environment\" takes no keys".into());
            }
            let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
            let (Some(key), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) else {
                return Err(
                    "source = \"environment\", but the host has no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".into(),
                );
            };
            Ok(Credentials::new(key, secret, var("AWS_SESSION_TOKEN"), None, "the host's environment"))
        }
        Some(other) => Err(format!("source {other:?} is not \"file\" or \"environment\"")),
    }
}

/// The headers a signature consists of: a guest's own are dropped before
/// signing (it cannot sign, nor make the host send its forgery), and they
/// never come back to it.
pub const SIGNING_HEADERS: [&str; 4] = ["authorization", "x-amz-date", "x-amz-security-token", "x-amz-content-sha256"];

/// How a grant signs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsSigning {
    /// The service signed for (`ec2`).
    pub service: String,
    /// The region signed for (`eu-west-1`).
    pub region: String,
    /// The credentials' name under `DATA_DIR/credentials`.
    pub credentials: String,
}

/// Sign `request` (its URI absolute, its Host header set, its body `body`)
/// with `credentials`, adding the signature's headers.
pub fn sign(
    request: &mut http::Request<()>,
    body: &[u8],
    signing: &AwsSigning,
    credentials: Credentials,
) -> Result<(), SigningError> {
    use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign as sigv4};
    let identity = credentials.into();
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(&signing.region)
        .name(&signing.service)
        .time(std::time::SystemTime::now())
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| SigningError::Sign(e.to_string()))?
        .into();
    let uri = request.uri().to_string();
    let headers: Vec<(&str, &str)> =
        request.headers().iter().filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?))).collect();
    let signable = SignableRequest::new(request.method().as_str(), uri, headers.into_iter(), SignableBody::Bytes(body))
        .map_err(|e| SigningError::Sign(e.to_string()))?;
    let (instructions, _signature) =
        sigv4(signable, &params).map_err(|e| SigningError::Sign(e.to_string()))?.into_parts();
    instructions.apply_to_request_http1x(request);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_credentials_file_must_be_the_hosts_alone_and_is_read_again_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let credentials = CredentialsDir::new(dir.path().to_owned());
        let path = dir.path().join("prod.toml");
        let missing = credentials.get("prod").unwrap_err().to_string();
        assert!(missing.contains("no such file"), "{missing}");
        std::fs::write(&path, "access-key-id = \"AKIA1\"\nsecret-access-key = \"s3cr3t-one\"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let open = credentials.get("prod").unwrap_err().to_string();
        assert!(open.contains("chmod 600") && !open.contains("s3cr3t"), "{open}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let read = credentials.get("prod").unwrap();
        assert_eq!((read.access_key_id(), read.secret_access_key()), ("AKIA1", "s3cr3t-one"));
        assert!(!format!("{read:?}").contains("s3cr3t"), "Debug hides the secret");
        // Rewritten: read again.
        std::fs::write(&path, "access-key-id = \"AKIA2\"\nsecret-access-key = \"s3cr3t-two-longer\"\n").unwrap();
        assert_eq!(credentials.get("prod").unwrap().access_key_id(), "AKIA2");
        // A link to a good file is refused; so is a name that walks.
        std::os::unix::fs::symlink(&path, dir.path().join("linked.toml")).unwrap();
        assert!(credentials.get("linked").unwrap_err().to_string().contains("link"));
        assert!(credentials.get("../prod").is_err());
        // A malformed file says what is wrong without quoting it.
        std::fs::write(&path, "access-key-id = \"AKIA3\"\nsecret-access-key = s3cr3t-unquoted\n").unwrap();
        let bad = credentials.get("prod").unwrap_err().to_string();
        assert!(bad.contains("not valid") && !bad.contains("s3cr3t"), "{bad}");
    }

    #[test]
    fn a_signed_request_carries_the_signature_and_the_guests_forgery_is_not_kept() {
        let mut request = http::Request::post("https://ec2.eu-west-1.amazonaws.com/")
            .header("host", "ec2.eu-west-1.amazonaws.com")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(())
            .unwrap();
        let signing = AwsSigning { service: "ec2".into(), region: "eu-west-1".into(), credentials: "prod".into() };
        let credentials = Credentials::new("AKIA1", "s3cr3t", Some("tok3n".into()), None, "test");
        sign(&mut request, b"Action=DescribeRegions&Version=2016-11-15", &signing, credentials).unwrap();
        let authorization = request.headers()["authorization"].to_str().unwrap();
        assert!(authorization.starts_with("AWS4-HMAC-SHA256 Credential=AKIA1/"), "{authorization}");
        assert!(authorization.contains("/eu-west-1/ec2/aws4_request"), "{authorization}");
        assert!(!authorization.contains("s3cr3t"));
        assert_eq!(request.headers()["x-amz-security-token"], "tok3n");
        assert!(request.headers().contains_key("x-amz-date"));
    }
}
