//! What can go wrong in one call to a provider, each naming provider and method.

use crate::manifest::Method;
use broker_capabilities::bindings::BrokerError;
use std::time::Duration;

/// Why one call to a provider did not return its answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The provider answered with a typed error (the inner result of the call).
    #[error("provider {provider}: {method}: {}", describe_broker_error(.error))]
    Guest {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// What the provider answered.
        error: BrokerError,
    },
    /// The guest trapped; its instance is discarded.
    #[error("provider {provider}: {method} trapped: {reason}{}", quoted_stderr(.stderr))]
    Trap {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// The trap code, or wasmtime's error text.
        reason: String,
        /// The guest's last stderr lines in this call (a panic's message,
        /// file and line), redacted; empty if it wrote none.
        stderr: Vec<String>,
    },
    /// The call ran past the method's deadline; its instance is discarded.
    #[error("provider {provider}: {method} exceeded its deadline of {deadline:?} and was stopped")]
    Deadline {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// The method's deadline, instantiation included.
        deadline: Duration,
    },
    /// The guest hit a store limit; its instance is discarded.
    #[error("provider {provider}: {method} was stopped: it hit its {limit}")]
    Limit {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// Which limit, as the limiter names it.
        limit: String,
    },
    /// No instance could be made to run the call on.
    #[error("provider {provider}: {method}: cannot instantiate the component: {reason}")]
    Instantiate {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// wasmtime's error text.
        reason: String,
    },
    /// The host could not make the call's kv changes durable (the host's
    /// storage failed, not the provider).
    #[error("provider {provider}: {method}: the host could not make its kv changes durable: {}", broker_capabilities::error_text::cause_text(.cause))]
    Storage {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// The store's failure.
        cause: broker_capabilities::rooms::kv::KvError,
    },
    /// The provider already ran its `max-concurrent-calls`, and none ended
    /// within `queue-wait`.
    #[error(
        "provider {provider}: {method} refused: busy: {limit} calls already running ([limits] max-concurrent-calls), none ended within {waited:?}"
    )]
    Busy {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// Its `max-concurrent-calls`.
        limit: usize,
        /// Its `queue-wait`.
        waited: Duration,
    },
    /// Half-open after repeated crashes, and its `all-instances` re-observe failed.
    #[error("provider {provider}: {method} refused: the provider is half-open ({reason})")]
    Unavailable {
        /// The provider called.
        provider: String,
        /// The export called.
        method: Method,
        /// The crash policy and why the re-observe failed.
        reason: String,
    },
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

/// `; its last stderr lines: "…" | "…"`, or nothing for none.
fn quoted_stderr(lines: &[String]) -> String {
    if lines.is_empty() {
        return String::new();
    }
    let quoted: Vec<String> = lines.iter().map(|line| format!("{line:?}")).collect();
    format!("; its last stderr lines: {}", quoted.join(" | "))
}

/// `invalid-params: …` style text for a contract error.
pub(crate) fn describe_broker_error(error: &BrokerError) -> String {
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
