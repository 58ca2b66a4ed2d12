//! Signing by the host: a grant that says `sign = "aws-sigv4"` has its
//! requests signed here, with a credential the guest never sees, after the
//! grant's rules passed ([`super::rules`]).
//!
//! Credentials live in `DATA_DIR/credentials/<name>.toml`, written by the
//! operator: refused unless a regular file owned by the host's user and
//! readable by no one else (opened without following a link), read again
//! when it changes. The file may instead say `source = "environment"`: the
//! host's own `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
//! `AWS_SESSION_TOKEN`; or `source = "profile"` (with `profile = "NAME"`, else
//! `AWS_PROFILE`, else `default`): the keys that profile holds in the host
//! user's AWS config files. The secret is held in [`Credentials`], whose
//! `Debug` hides it, and goes nowhere but into the signature.

use crate::secrets::{FileVersion, open_private};
use aws_credential_types::Credentials;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    /// `"file"` (the default: the keys below), `"environment"` or `"profile"`.
    #[serde(default)]
    source: Option<String>,
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    session_token: Option<String>,
    /// With `source = "profile"`: which (else `AWS_PROFILE`, else `default`).
    profile: Option<String>,
}

/// How often credentials from an AWS profile are read again: the profile
/// files are the operator's, outside the credentials dir, and not watched.
const PROFILE_REREAD: Duration = Duration::from_secs(30);

/// A credentials file read, and what it gave.
struct Cached {
    version: FileVersion,
    credentials: Credentials,
    /// When they came from an AWS profile (read again after [`PROFILE_REREAD`]).
    from_profile_at: Option<Instant>,
}

/// `DATA_DIR/credentials`: the credentials grants name, read as they change.
pub(crate) struct CredentialsDir {
    dir: PathBuf,
    cache: Mutex<HashMap<String, Cached>>,
}

impl std::fmt::Debug for CredentialsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialsDir").field("dir", &self.dir).finish()
    }
}

/// A credentials name: what the file is called, and nothing that walks.
pub fn check_name(name: &str) -> Result<(), String> {
    crate::secrets::check_name("credentials", name)
}

impl CredentialsDir {
    /// The credentials under `dir` (`DATA_DIR/credentials`).
    pub(crate) fn new(dir: PathBuf) -> CredentialsDir {
        CredentialsDir { dir, cache: Mutex::default() }
    }

    /// The credentials called `name`, read again if its file changed (and,
    /// from an AWS profile, every [`PROFILE_REREAD`]).
    pub(crate) async fn get(&self, name: &str) -> Result<Credentials, SigningError> {
        let path = self.dir.join(format!("{name}.toml"));
        let refuse = |reason: String| SigningError::Credentials { name: name.to_owned(), path: path.clone(), reason };
        check_name(name).map_err(refuse)?;
        let file = open_private(&self.dir, &format!("{name}.toml"), MAX_FILE).map_err(|e| refuse(e.to_string()))?;
        let version = file.version;
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(cached) = cache.get(name)
                && cached.version == version
                && cached.from_profile_at.is_none_or(|at| at.elapsed() < PROFILE_REREAD)
            {
                return Ok(cached.credentials.clone());
            }
        }
        let bytes = file.read(MAX_FILE).map_err(|e| refuse(e.to_string()))?;
        let text = String::from_utf8(bytes).map_err(|_| refuse("not UTF-8 text".into()))?;
        // The parser's message could quote the line it failed on: the secret's, perhaps.
        let parsed: CredentialsFile = toml::from_str(&text).map_err(|e| {
            refuse(format!(
                "not valid: {} (keys: access-key-id, secret-access-key, session-token; \
                 or source = \"environment\"; or source = \"profile\" with an optional profile)",
                e.message()
            ))
        })?;
        let from_profile = parsed.source.as_deref() == Some("profile");
        let credentials = match from_profile {
            true => {
                use aws_types::os_shim_internal::{Env, Fs};
                from_aws_profile(parsed, &Env::real(), &Fs::real()).await
            }
            false => from_file(parsed),
        }
        .map_err(refuse)?;
        let cached =
            Cached { version, credentials: credentials.clone(), from_profile_at: from_profile.then(Instant::now) };
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_owned(), cached);
        Ok(credentials)
    }
}

fn from_file(file: CredentialsFile) -> Result<Credentials, String> {
    if file.profile.is_some() {
        return Err("profile goes with source = \"profile\"".into());
    }
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
        Some(other) => Err(format!("source {other:?} is not \"file\", \"environment\" or \"profile\"")),
    }
}

/// What in a profile says its keys come from elsewhere: a role to assume, a
/// program, SSO, a web identity. The host signs only with keys a profile holds.
const INDIRECT_PROFILE_KEYS: [&str; 6] =
    ["role_arn", "credential_process", "sso_session", "sso_start_url", "web_identity_token_file", "credential_source"];

/// The host user's AWS profile (`~/.aws/credentials` and `~/.aws/config`, or
/// `AWS_SHARED_CREDENTIALS_FILE` and `AWS_CONFIG_FILE`), parsed by the SDK's
/// own profile parser.
async fn from_aws_profile(
    file: CredentialsFile,
    env: &aws_types::os_shim_internal::Env,
    fs: &aws_types::os_shim_internal::Fs,
) -> Result<Credentials, String> {
    use aws_runtime::env_config::{file::EnvConfigFiles, section::EnvConfigSections, source};
    if file.access_key_id.is_some() || file.secret_access_key.is_some() || file.session_token.is_some() {
        return Err("source = \"profile\" takes no keys".into());
    }
    // The SDK's parser logs a line it ignores, which could be a key's: not here.
    let quiet = tracing::Dispatch::none();
    let loaded = tracing::instrument::WithSubscriber::with_subscriber(
        source::load(env, fs, &EnvConfigFiles::default()),
        quiet.clone(),
    )
    .await
    .map_err(|e| format!("the host's AWS config files: {e}"))?;
    // Its errors name the file and line, never what is on it.
    let sections = tracing::dispatcher::with_default(&quiet, || EnvConfigSections::parse(loaded))
        .map_err(|e| format!("the host's AWS config files: {e}"))?;
    let name = file.profile.unwrap_or_else(|| sections.selected_profile().to_owned());
    let Some(profile) = sections.get_profile(&name) else {
        return Err(format!(
            "profile {name:?} is in neither the host's ~/.aws/credentials nor ~/.aws/config \
             (or AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE)"
        ));
    };
    let value = |key: &str| profile.get(key).filter(|v| !v.is_empty());
    match (value("aws_access_key_id"), value("aws_secret_access_key")) {
        (Some(key), Some(secret)) => Ok(Credentials::new(
            key,
            secret,
            value("aws_session_token").map(str::to_owned),
            None,
            "the host's AWS profile",
        )),
        _ => Err(match INDIRECT_PROFILE_KEYS.into_iter().find(|key| profile.get(key).is_some()) {
            Some(how) => format!(
                "profile {name:?} gets its keys by {how}: the host signs only with keys a profile holds \
                 (`aws configure export-credentials --profile {name}` gives them)"
            ),
            None => format!("profile {name:?} has no aws_access_key_id and aws_secret_access_key"),
        }),
    }
}

/// The headers a signature consists of: a guest's own are dropped before
/// signing (it cannot sign, nor make the host send its forgery), and they
/// never come back to it.
pub(crate) const SIGNING_HEADERS: [&str; 4] =
    ["authorization", "x-amz-date", "x-amz-security-token", "x-amz-content-sha256"];

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

    #[tokio::test]
    async fn a_credentials_file_must_be_the_hosts_alone_and_is_read_again_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let credentials = CredentialsDir::new(dir.path().to_owned());
        let path = dir.path().join("prod.toml");
        let missing = credentials.get("prod").await.unwrap_err().to_string();
        assert!(missing.contains("no such file"), "{missing}");
        std::fs::write(&path, "access-key-id = \"AKIA1\"\nsecret-access-key = \"s3cr3t-one\"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let open = credentials.get("prod").await.unwrap_err().to_string();
        assert!(open.contains("chmod 600") && !open.contains("s3cr3t"), "{open}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let read = credentials.get("prod").await.unwrap();
        assert_eq!((read.access_key_id(), read.secret_access_key()), ("AKIA1", "s3cr3t-one"));
        assert!(!format!("{read:?}").contains("s3cr3t"), "Debug hides the secret");
        // Rewritten: read again.
        std::fs::write(&path, "access-key-id = \"AKIA2\"\nsecret-access-key = \"s3cr3t-two-longer\"\n").unwrap();
        assert_eq!(credentials.get("prod").await.unwrap().access_key_id(), "AKIA2");
        // A link to a good file is refused; so is a name that walks.
        std::os::unix::fs::symlink(&path, dir.path().join("linked.toml")).unwrap();
        assert!(credentials.get("linked").await.unwrap_err().to_string().contains("link"));
        assert!(credentials.get("../prod").await.is_err());
        // A malformed file says what is wrong without quoting it.
        std::fs::write(&path, "access-key-id = \"AKIA3\"\nsecret-access-key = s3cr3t-unquoted\n").unwrap();
        let bad = credentials.get("prod").await.unwrap_err().to_string();
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

    #[tokio::test]
    async fn an_aws_profile_gives_the_keys_it_holds_and_says_why_not_otherwise() {
        use aws_types::os_shim_internal::{Env, Fs};
        let env = Env::from_slice(&[("HOME", "/home/op"), ("AWS_PROFILE", "ops")]);
        let fs = Fs::from_slice(&[
            (
                "/home/op/.aws/credentials",
                "[default]\naws_access_key_id = AKIADEF\naws_secret_access_key = def-s3cr3t\n\
                 [ops]\naws_access_key_id = AKIAOPS\naws_secret_access_key = ops-s3cr3t\naws_session_token = tok\n",
            ),
            (
                "/home/op/.aws/config",
                "[profile assumed]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = default\n[profile empty]\nregion = r1\n",
            ),
        ]);
        let file = |profile: Option<&str>| CredentialsFile {
            source: Some("profile".into()),
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            profile: profile.map(str::to_owned),
        };
        let ops = from_aws_profile(file(None), &env, &fs).await.unwrap();
        assert_eq!(
            (ops.access_key_id(), ops.secret_access_key(), ops.session_token()),
            ("AKIAOPS", "ops-s3cr3t", Some("tok"))
        );
        let default = from_aws_profile(file(Some("default")), &env, &fs).await.unwrap();
        assert_eq!(default.access_key_id(), "AKIADEF");
        let assumed = from_aws_profile(file(Some("assumed")), &env, &fs).await.unwrap_err();
        assert!(assumed.contains("by role_arn") && assumed.contains("export-credentials"), "{assumed}");
        let empty = from_aws_profile(file(Some("empty")), &env, &fs).await.unwrap_err();
        assert!(empty.contains("has no aws_access_key_id"), "{empty}");
        let missing = from_aws_profile(file(Some("nope")), &env, &fs).await.unwrap_err();
        assert!(missing.contains("in neither"), "{missing}");
        let mut keyed = file(None);
        keyed.secret_access_key = Some("x".into());
        assert!(from_aws_profile(keyed, &env, &fs).await.unwrap_err().contains("takes no keys"));
        let broken = Fs::from_slice(&[("/home/op/.aws/credentials", "[ops]\naws_secret_access_key broken-s3cr3t\n")]);
        let unparsed = from_aws_profile(file(None), &env, &broken).await.unwrap_err();
        assert!(unparsed.contains("line 2") && !unparsed.contains("s3cr3t"), "{unparsed}");
    }
}
