//! A client of the InfraKit sockets, speaking exactly what InfraKit's own
//! `pkg/rpc/client` does: a `Handshake.Hello` first (refusing a plugin that
//! does not serve the expected interface and version), then JSON-RPC 2.0
//! calls as `POST /`. The tests drive the sockets with it; it is also the
//! shape of what a tool of the host's own would use.

use super::rpc::{Response, RpcError};
use http::Method;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a call did not get an answer (as opposed to an answer that is an error).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing answers on the socket.
    #[error("cannot reach the InfraKit plugin on {socket}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Connect {
        /// The socket.
        socket: String,
        /// Why.
        cause: std::io::Error,
    },
    /// The exchange broke off or did not parse.
    #[error("the InfraKit plugin on {socket} answered unreadably: {why}")]
    Answer {
        /// The socket.
        socket: String,
        /// What was wrong.
        why: String,
    },
    /// The plugin does not serve the interface asked for.
    #[error("the plugin on {socket} does not serve {wanted}: its objects are {objects}")]
    WrongPlugin {
        /// The socket.
        socket: String,
        /// `Group/0.1.1`.
        wanted: String,
        /// What it answered to `Handshake.Hello`.
        objects: String,
    },
}

/// One plugin socket.
pub struct InfrakitClient {
    socket: PathBuf,
    next_id: AtomicU64,
}

impl InfrakitClient {
    /// A client of `socket`; nothing is sent until a call.
    pub fn new(socket: &Path) -> InfrakitClient {
        InfrakitClient { socket: socket.to_owned(), next_id: AtomicU64::new(1) }
    }

    /// `Handshake.Hello`, then check that `api` (`Group/0.1.1`) is among
    /// the objects served, as InfraKit's clients do before any call.
    pub async fn hello(&self, api: &str) -> Result<Value, ClientError> {
        let answer = self.call("Handshake.Hello", json!({})).await?;
        let objects = answer.as_ref().ok().and_then(|result| result.get("Objects")).cloned().unwrap_or(Value::Null);
        match objects.get(api).and_then(Value::as_array) {
            Some(served) if !served.is_empty() => Ok(objects),
            _ => Err(ClientError::WrongPlugin {
                socket: self.socket.display().to_string(),
                wanted: api.to_owned(),
                objects: objects.to_string(),
            }),
        }
    }

    /// Call `method` with `params`: the result, or the plugin's error.
    pub async fn call(&self, method: &str, params: Value) -> Result<Result<Value, RpcError>, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let request = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": id});
        let (_, body) = self.post(&request.to_string()).await?;
        let response: Response = serde_json::from_value(body).map_err(|e| self.unreadable(e))?;
        if response.id != json!(id) {
            return Err(self.unreadable(format!("the answer's id {} is not the request's {id}", response.id)));
        }
        match (response.result, response.error) {
            (_, Some(error)) => Ok(Err(error)),
            (Some(result), None) => Ok(Ok(result)),
            (None, None) => Err(self.unreadable("neither a result nor an error")),
        }
    }

    /// `POST /` with `body` as it is (tests of bad requests): the HTTP status and the JSON answer.
    pub async fn post(&self, body: &str) -> Result<(u16, Value), ClientError> {
        self.exchange(Method::POST, "/", body.to_owned()).await
    }

    /// `GET path` (`/info/api.json`): the HTTP status and the JSON answer.
    pub async fn get(&self, path: &str) -> Result<(u16, Value), ClientError> {
        self.exchange(Method::GET, path, String::new()).await
    }

    async fn exchange(&self, method: Method, path: &str, body: String) -> Result<(u16, Value), ClientError> {
        let response =
            crate::client::send_unix(&self.socket, method, path, body).await.map_err(|failed| match failed {
                crate::client::SendError::Connect(source) => {
                    ClientError::Connect { socket: self.socket.display().to_string(), cause: source }
                }
                crate::client::SendError::Http(why) => self.unreadable(why),
            })?;
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.map_err(|e| self.unreadable(e))?.to_bytes();
        let value = serde_json::from_slice(&bytes).map_err(|e| self.unreadable(e))?;
        Ok((status, value))
    }

    fn unreadable(&self, why: impl std::fmt::Display) -> ClientError {
        ClientError::Answer { socket: self.socket.display().to_string(), why: why.to_string() }
    }
}
