//! LXD's REST API (`/1.0/…`, shared by Incus) through the granted authority:
//! requests in the configured project, operations waited on, errors typed.

use crate::http::{self, Failure};
use broker_guest::types::BrokerError;
use lxd_logic::Config;
use lxd_logic::api::{self, Reply};
use serde_json::{Value, json};
use wasip2::http::types::{ErrorCode, Method};

pub struct Lxd<'a> {
    config: &'a Config,
}

fn method_name(method: &Method) -> &'static str {
    match method {
        Method::Get => "GET",
        Method::Post => "POST",
        Method::Put => "PUT",
        Method::Delete => "DELETE",
        _ => "other",
    }
}

impl<'a> Lxd<'a> {
    pub fn new(config: &'a Config) -> Self {
        Lxd { config }
    }

    fn failure(&self, method: &Method, path: &str, failure: Failure) -> BrokerError {
        let authority = &self.config.authority;
        match failure {
            Failure::Http(ErrorCode::HttpRequestDenied) => BrokerError::AccessDenied(format!(
                "the host denied http to authority `{authority}`: the manifest needs \
                 `{authority} = \"unix:/path/to/unix.socket\"` under [grants.http]"
            )),
            Failure::Http(code @ (ErrorCode::DestinationNotFound | ErrorCode::ConnectionRefused)) => {
                BrokerError::Provider(format!(
                    "cannot reach LXD through authority `{authority}` ({code:?}): is the daemon running?"
                ))
            }
            Failure::Http(code) => {
                BrokerError::Provider(format!("LXD request {} {path} failed: {code:?}", method_name(method)))
            }
            Failure::Io(message) => {
                BrokerError::Provider(format!("LXD request {} {path} failed: {message}", method_name(method)))
            }
        }
    }

    /// One request in the configured project; the envelope, not yet judged.
    pub fn call(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Reply, BrokerError> {
        let separator = if path.contains('?') { '&' } else { '?' };
        let url = format!("{path}{separator}project={}", self.config.project);
        let bytes = body.map(|b| b.to_string().into_bytes());
        let response = http::request(method.clone(), &self.config.authority, &url, bytes.as_deref())
            .map_err(|f| self.failure(&method, path, f))?;
        api::parse_reply(response.status, &response.body).map_err(crate::from_logic)
    }

    /// A request whose answer must be a plain (sync) success.
    pub fn get(&self, path: &str) -> Result<Value, BrokerError> {
        match self.call(Method::Get, path, None)? {
            Reply::Sync(metadata) => Ok(metadata),
            Reply::Async { operation } => {
                Err(BrokerError::Provider(format!("GET {path} unexpectedly started {operation}")))
            }
            Reply::Error { code: 404, message } => Err(BrokerError::NotFound(message)),
            Reply::Error { message, .. } => Err(BrokerError::Provider(message)),
        }
    }

    /// Wait for a background operation to finish; its error text on failure.
    pub fn wait(&self, operation: &str) -> Result<(), String> {
        let path = format!("{operation}/wait?timeout={}", self.config.operation_timeout_s);
        match self.call(Method::Get, &path, None) {
            Ok(Reply::Sync(metadata)) => api::operation_outcome(&metadata),
            Ok(Reply::Error { message, .. }) => Err(message),
            Ok(Reply::Async { .. }) => Err(format!("waiting on {operation} started another operation")),
            Err(err) => Err(err.message().to_owned()),
        }
    }

    /// A request that may run as an operation: done when the operation is.
    pub fn act(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Result<(), (u16, String)>, BrokerError> {
        Ok(match self.call(method, path, body)? {
            Reply::Sync(_) => Ok(()),
            Reply::Async { operation } => self.wait(&operation).map_err(|message| (0, message)),
            Reply::Error { code, message } => Err((code, message)),
        })
    }

    pub fn instance(&self, name: &str) -> Result<Option<Value>, BrokerError> {
        match self.get(&format!("/1.0/instances/{name}")) {
            Ok(instance) => Ok(Some(instance)),
            Err(BrokerError::NotFound(_)) => Ok(None),
            Err(err) => Err(err),
        }
    }

    pub fn instances(&self) -> Result<Vec<Value>, BrokerError> {
        match self.get("/1.0/instances?recursion=1")? {
            Value::Array(items) => Ok(items),
            other => Err(BrokerError::Provider(format!("LXD listed instances as {other}"))),
        }
    }

    pub fn image_alias_exists(&self, alias: &str) -> Result<bool, BrokerError> {
        match self.get(&format!("/1.0/images/aliases/{alias}")) {
            Ok(_) => Ok(true),
            Err(BrokerError::NotFound(_)) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// `PUT …/state`: start, or stop (forced).
    pub fn change_state(
        &self,
        name: &str,
        action: &str,
        force: bool,
    ) -> Result<Result<(), (u16, String)>, BrokerError> {
        let body = json!({ "action": action, "timeout": 30, "force": force });
        self.act(Method::Put, &format!("/1.0/instances/{name}/state"), Some(&body))
    }
}
