//! What can go wrong in one call to a provider, each naming provider and method.

use crate::bindings::BrokerError;
use crate::manifest::Method;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The provider answered with a typed error (the inner result of the call).
    #[error("provider {provider}: {method}: {}", describe_broker_error(.error))]
    Guest { provider: String, method: Method, error: BrokerError },
    #[error("provider {provider}: {method} trapped: {reason}")]
    Trap { provider: String, method: Method, reason: String },
    #[error("provider {provider}: {method} exceeded its deadline of {deadline:?} and was stopped")]
    Deadline { provider: String, method: Method, deadline: Duration },
    #[error("provider {provider}: {method} was stopped: it hit its {limit}")]
    Limit { provider: String, method: Method, limit: String },
    #[error("provider {provider}: {method}: cannot instantiate the component: {reason}")]
    Instantiate { provider: String, method: Method, reason: String },
    /// The host could not make the call's kv changes durable (the host's
    /// storage failed, not the provider).
    #[error("provider {provider}: {method}: the host could not make its kv changes durable: {source}")]
    Storage {
        provider: String,
        method: Method,
        #[source]
        source: crate::capabilities::kv::KvError,
    },
    /// Half-open after repeated crashes, and its `all-instances` re-observe failed.
    #[error("provider {provider}: {method} refused: the provider is half-open ({reason})")]
    Unavailable { provider: String, method: Method, reason: String },
}

impl CallError {
    /// The guest's typed error, if that is what this is.
    pub fn broker_error(&self) -> Option<&BrokerError> {
        match self {
            CallError::Guest { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// `invalid-params: …` style text for a contract error.
pub fn describe_broker_error(error: &BrokerError) -> String {
    let (kind, message) = match error {
        BrokerError::InvalidParams(m) => ("invalid params", m),
        BrokerError::NotFound(m) => ("not found", m),
        BrokerError::NotSupported(m) => ("not supported", m),
        BrokerError::ZoneIndependent(m) => ("zone independent", m),
        BrokerError::ZoneUnavailable(m) => ("zone unavailable", m),
        BrokerError::AccessDenied(m) => ("access denied", m),
        BrokerError::Aborted(m) => ("aborted", m),
        BrokerError::Timeout(m) => ("timeout", m),
        BrokerError::Provider(m) => ("provider error", m),
    };
    format!("{kind}: {message}")
}
