//! Every error the host reports, as one object: its kind (what a program
//! branches on), its message (what a person reads) and what it is about.
//! The API answers it as `{"error": …}`, the CLI prints it with `--json` and
//! exits with its kind's code.

use crate::broker::BrokerServiceError;
use crate::groups::GroupError;
use crate::providers::registry::RegistryError;
use crate::store::StoreError;
use crate::version::{CallError, LoadError};
use broker_capabilities::bindings::BrokerError;
use broker_capabilities::error_text::error_text;
use serde::{Deserialize, Serialize};

/// What kind of failure an error is. Serialised in kebab-case; a kind a newer
/// host adds reads as [`ErrorKind::Other`] to an older client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// The request or the command is malformed (a body, a query, a spec, params the host checks).
    BadRequest,
    /// A manifest or component the host will not load (or a provider's config it refused).
    InvalidProvider,
    /// The provider answered `invalid-params`.
    InvalidParams,
    /// The provider answered `not-found`.
    NotFound,
    /// No provider of that name is registered.
    UnknownProvider,
    /// The host has no record of that instance.
    UnknownInstance,
    /// No group of that id is committed.
    UnknownGroup,
    /// The host's state forbids it now (already registered, instances left,
    /// an ambiguous id, a spec that cannot replace the committed one).
    Conflict,
    /// The provider answered `not-supported`.
    NotSupported,
    /// The provider answered `zone-independent`.
    ZoneIndependent,
    /// The provider answered `zone-unavailable`.
    ZoneUnavailable,
    /// The provider answered `access-denied`.
    AccessDenied,
    /// The provider answered `aborted`.
    Aborted,
    /// The provider answered `timeout`.
    Timeout,
    /// The provider answered `provider` (its own or its infrastructure's failure).
    ProviderError,
    /// The provider answered something the host does not take (an unusable
    /// or reused instance id); nothing was recorded.
    BadAnswer,
    /// The guest trapped (a panic, or it broke the contract); its instance was discarded.
    Trap,
    /// The call ran past its deadline and was stopped.
    Deadline,
    /// The guest hit one of its limits (memory, records, call data) and was stopped.
    Limit,
    /// No instance of the component could be made.
    Instantiate,
    /// The provider already runs its `max-concurrent-calls`: try again.
    Busy,
    /// The provider is half-open, being removed, or the daemon is shutting down: try again.
    Unavailable,
    /// The host's own storage failed; nothing the request asked was lost or half made.
    Storage,
    /// The daemon could not be reached.
    Unreachable,
    /// Anything else (a failure inside the host; its log says more).
    #[serde(other)]
    Other,
}

impl ErrorKind {
    /// Every kind, in the order the README's table lists them.
    pub const ALL: [ErrorKind; 25] = [
        ErrorKind::BadRequest,
        ErrorKind::InvalidProvider,
        ErrorKind::InvalidParams,
        ErrorKind::NotFound,
        ErrorKind::UnknownProvider,
        ErrorKind::UnknownInstance,
        ErrorKind::UnknownGroup,
        ErrorKind::Conflict,
        ErrorKind::NotSupported,
        ErrorKind::ZoneIndependent,
        ErrorKind::ZoneUnavailable,
        ErrorKind::AccessDenied,
        ErrorKind::Aborted,
        ErrorKind::Timeout,
        ErrorKind::ProviderError,
        ErrorKind::BadAnswer,
        ErrorKind::Trap,
        ErrorKind::Deadline,
        ErrorKind::Limit,
        ErrorKind::Instantiate,
        ErrorKind::Busy,
        ErrorKind::Unavailable,
        ErrorKind::Storage,
        ErrorKind::Unreachable,
        ErrorKind::Other,
    ];

    /// The `broker` command's exit code for an error of this kind (2 is a
    /// usage error, found before anything runs).
    pub fn exit_code(self) -> u8 {
        use ErrorKind::*;
        match self {
            Other => 1,
            BadRequest | InvalidProvider | InvalidParams => 3,
            NotFound | UnknownProvider | UnknownInstance | UnknownGroup => 4,
            Conflict => 5,
            NotSupported | ZoneIndependent | ZoneUnavailable | AccessDenied | Aborted | Timeout | ProviderError => 6,
            BadAnswer | Trap | Deadline | Limit | Instantiate => 7,
            Busy | Unavailable => 8,
            Storage => 9,
            Unreachable => 10,
        }
    }

    /// The kind's name, as serialised.
    pub fn name(self) -> &'static str {
        use ErrorKind::*;
        match self {
            BadRequest => "bad-request",
            InvalidProvider => "invalid-provider",
            InvalidParams => "invalid-params",
            NotFound => "not-found",
            UnknownProvider => "unknown-provider",
            UnknownInstance => "unknown-instance",
            UnknownGroup => "unknown-group",
            Conflict => "conflict",
            NotSupported => "not-supported",
            ZoneIndependent => "zone-independent",
            ZoneUnavailable => "zone-unavailable",
            AccessDenied => "access-denied",
            Aborted => "aborted",
            Timeout => "timeout",
            ProviderError => "provider-error",
            BadAnswer => "bad-answer",
            Trap => "trap",
            Deadline => "deadline",
            Limit => "limit",
            Instantiate => "instantiate",
            Busy => "busy",
            Unavailable => "unavailable",
            Storage => "storage",
            Unreachable => "unreachable",
            Other => "other",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One error as the host reports it: `{"kind", "message", "provider", "method", "instance"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReport {
    /// What kind of failure it is.
    pub kind: ErrorKind,
    /// The whole message, causes included (what the CLI prints).
    pub message: String,
    /// The provider it is about, if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// The provider's export that failed (`start-instance`, …), if a call did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The instance it is about, if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

impl ErrorReport {
    /// A report of `kind` with `message` and nothing it is about.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ErrorReport { kind, message: message.into(), provider: None, method: None, instance: None }
    }

    /// The same report, about `provider` unless it already names one.
    pub fn about_provider(mut self, provider: &str) -> Self {
        self.provider.get_or_insert_with(|| provider.to_owned());
        self
    }

    /// The same report, about `instance` unless it already names one.
    pub fn about_instance(mut self, instance: &str) -> Self {
        self.instance.get_or_insert_with(|| instance.to_owned());
        self
    }

    /// The report of the first error in `chain` the host knows the kind of
    /// (`chain` is an `anyhow` chain: outermost first), with the message of
    /// the whole chain; [`ErrorKind::Other`] if none is known.
    pub fn of_chain<'a>(
        chain: impl Iterator<Item = &'a (dyn std::error::Error + 'static)> + Clone,
        message: String,
    ) -> Self {
        for error in chain {
            if let Some(known) = known_report(error) {
                return ErrorReport { message, ..known };
            }
        }
        ErrorReport::new(ErrorKind::Other, message)
    }
}

/// The report of an error of a type the host classifies.
fn known_report(error: &(dyn std::error::Error + 'static)) -> Option<ErrorReport> {
    if let Some(e) = error.downcast_ref::<BrokerServiceError>() {
        return Some(e.report());
    }
    if let Some(e) = error.downcast_ref::<RegistryError>() {
        return Some(e.report());
    }
    if let Some(e) = error.downcast_ref::<CallError>() {
        return Some(e.report());
    }
    if let Some(e) = error.downcast_ref::<GroupError>() {
        return Some(e.report());
    }
    if let Some(e) = error.downcast_ref::<LoadError>() {
        return Some(ErrorReport::new(ErrorKind::InvalidProvider, error_text(e)));
    }
    if let Some(e) = error.downcast_ref::<StoreError>() {
        return Some(store_report(e));
    }
    if let Some(e) = error.downcast_ref::<crate::conformance::ConformanceError>() {
        let kind = match e {
            crate::conformance::ConformanceError::Load(_) => ErrorKind::InvalidProvider,
            crate::conformance::ConformanceError::Script { .. }
            | crate::conformance::ConformanceError::Scenarios { .. } => ErrorKind::BadRequest,
            _ => ErrorKind::Other,
        };
        return Some(ErrorReport::new(kind, error_text(e)));
    }
    if let Some(e) = error.downcast_ref::<crate::manifest::ManifestError>() {
        return Some(ErrorReport::new(ErrorKind::InvalidProvider, error_text(e)));
    }
    None
}

/// The state file held by another process is a wait, not a failure of storage.
fn store_report(error: &StoreError) -> ErrorReport {
    let kind = match error {
        StoreError::Busy { .. } => ErrorKind::Unavailable,
        _ => ErrorKind::Storage,
    };
    ErrorReport::new(kind, error_text(error))
}

/// The kind of a provider's typed error.
fn guest_kind(error: &BrokerError) -> ErrorKind {
    match error {
        BrokerError::InvalidParams(_) => ErrorKind::InvalidParams,
        BrokerError::NotFound(_) => ErrorKind::NotFound,
        BrokerError::NotSupported(_) => ErrorKind::NotSupported,
        BrokerError::ZoneIndependent(_) => ErrorKind::ZoneIndependent,
        BrokerError::ZoneUnavailable(_) => ErrorKind::ZoneUnavailable,
        BrokerError::AccessDenied(_) => ErrorKind::AccessDenied,
        BrokerError::Aborted(_) => ErrorKind::Aborted,
        BrokerError::Timeout(_) => ErrorKind::Timeout,
        BrokerError::Provider(_) => ErrorKind::ProviderError,
    }
}

impl CallError {
    /// This error as the host reports it.
    pub fn report(&self) -> ErrorReport {
        let (kind, provider, method) = match self {
            CallError::Guest { provider, method, error } => (guest_kind(error), provider, method),
            CallError::Trap { provider, method, .. } => (ErrorKind::Trap, provider, method),
            CallError::Deadline { provider, method, .. } => (ErrorKind::Deadline, provider, method),
            CallError::Limit { provider, method, .. } => (ErrorKind::Limit, provider, method),
            CallError::Instantiate { provider, method, .. } => (ErrorKind::Instantiate, provider, method),
            CallError::Storage { provider, method, .. } => (ErrorKind::Storage, provider, method),
            CallError::Busy { provider, method, .. } => (ErrorKind::Busy, provider, method),
            CallError::Unavailable { provider, method, .. } => (ErrorKind::Unavailable, provider, method),
        };
        ErrorReport {
            kind,
            message: error_text(self),
            provider: Some(provider.clone()),
            method: Some(method.to_string()),
            instance: None,
        }
    }
}

impl RegistryError {
    /// This error as the host reports it.
    pub fn report(&self) -> ErrorReport {
        let message = error_text(self);
        let (kind, provider) = match self {
            RegistryError::Call(call) => return ErrorReport { message, ..call.report() },
            RegistryError::Store(_) => (ErrorKind::Storage, None),
            RegistryError::UnknownProvider(name) => (ErrorKind::UnknownProvider, Some(name)),
            RegistryError::AlreadyRegistered { name, .. }
            | RegistryError::HasInstances { name, .. }
            | RegistryError::SwapRefused { name, .. }
            | RegistryError::GrantsWidened { name, .. } => (ErrorKind::Conflict, Some(name)),
            RegistryError::ConfigRejected { name, .. } => (ErrorKind::InvalidProvider, Some(name)),
            RegistryError::Load(_)
            | RegistryError::Path { .. }
            | RegistryError::Candidate { .. }
            | RegistryError::InDataDir(_) => (ErrorKind::InvalidProvider, None),
            RegistryError::Removing(name) | RegistryError::DrainTimeout { name, .. } => {
                (ErrorKind::Unavailable, Some(name))
            }
        };
        ErrorReport { provider: provider.cloned(), ..ErrorReport::new(kind, message) }
    }
}

impl BrokerServiceError {
    /// This error as the host reports it.
    pub fn report(&self) -> ErrorReport {
        let message = error_text(self);
        let (kind, provider, instance) = match self {
            BrokerServiceError::Registry(inner) => return ErrorReport { message, ..inner.report() },
            BrokerServiceError::Call(inner) => return ErrorReport { message, ..inner.report() },
            BrokerServiceError::Store(inner) => return ErrorReport { message, ..store_report(inner) },
            BrokerServiceError::UnknownInstance(id) => (ErrorKind::UnknownInstance, None, Some(id)),
            BrokerServiceError::AmbiguousInstance { id, .. } => (ErrorKind::Conflict, None, Some(id)),
            BrokerServiceError::AtRecordBound { provider, .. } => (ErrorKind::Limit, Some(provider), None),
            BrokerServiceError::EndlessListing { provider, .. } => (ErrorKind::BadAnswer, Some(provider), None),
            BrokerServiceError::RecordFailed { provider, id, .. } => (ErrorKind::Storage, Some(provider), Some(id)),
            BrokerServiceError::InvalidInstanceId { provider, id, .. }
            | BrokerServiceError::InstanceIdReused { provider, id }
            | BrokerServiceError::InstanceIdTaken { provider, id, .. } => {
                (ErrorKind::BadAnswer, Some(provider), Some(id))
            }
            BrokerServiceError::HostConfig { .. } | BrokerServiceError::Recorded(_) | BrokerServiceError::ByName(_) => {
                (ErrorKind::BadRequest, None, None)
            }
            BrokerServiceError::Runtime(_)
            | BrokerServiceError::Lock(_)
            | BrokerServiceError::Prepare(_)
            | BrokerServiceError::NoNetwork => (ErrorKind::Other, None, None),
        };
        ErrorReport { provider: provider.cloned(), instance: instance.cloned(), ..ErrorReport::new(kind, message) }
    }
}

impl GroupError {
    /// This error as the host reports it.
    pub fn report(&self) -> ErrorReport {
        let message = error_text(self);
        let kind = match self {
            GroupError::Broker(inner) => return ErrorReport { message, ..inner.report() },
            GroupError::Spec(_) => ErrorKind::BadRequest,
            GroupError::UnknownGroup(_) => ErrorKind::UnknownGroup,
            GroupError::UnknownProvider(_) => ErrorKind::UnknownProvider,
            GroupError::ProviderChanged { .. }
            | GroupError::AllocationChanged { .. }
            | GroupError::NotAMember { .. }
            | GroupError::QuorumSize(_)
            | GroupError::TooManyGroups(_)
            | GroupError::ProviderGone { .. } => ErrorKind::Conflict,
            GroupError::Store(_) => ErrorKind::Storage,
            GroupError::StoredSpec { .. } | GroupError::PassPanicked(_) => ErrorKind::Other,
            GroupError::StopsUnfinished { .. } => ErrorKind::ProviderError,
        };
        ErrorReport::new(kind, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Method;

    #[test]
    fn kinds_serialise_by_name_and_an_unknown_one_reads_as_other() {
        for kind in ErrorKind::ALL {
            assert_eq!(serde_json::to_value(kind).unwrap(), serde_json::json!(kind.name()));
            assert_eq!(serde_json::from_value::<ErrorKind>(serde_json::json!(kind.name())).unwrap(), kind);
        }
        let newer: ErrorKind = serde_json::from_str(r#""quota-of-the-future""#).unwrap();
        assert_eq!(newer, ErrorKind::Other);
        // Every code but 2 (usage) is some kind's, and none is 0.
        let codes: std::collections::BTreeSet<u8> = ErrorKind::ALL.iter().map(|k| k.exit_code()).collect();
        assert_eq!(codes.into_iter().collect::<Vec<_>>(), vec![1, 3, 4, 5, 6, 7, 8, 9, 10]);
    }

    #[test]
    fn a_call_error_reports_its_kind_provider_and_method_and_keeps_them_through_wrappers() {
        let call = CallError::Guest {
            provider: "fake".into(),
            method: Method::StartInstance,
            error: BrokerError::ZoneUnavailable("zone b is full".into()),
        };
        let report = BrokerServiceError::from(RegistryError::from(call)).report();
        assert_eq!(report.kind, ErrorKind::ZoneUnavailable);
        assert_eq!(report.provider.as_deref(), Some("fake"));
        assert_eq!(report.method.as_deref(), Some("start-instance"));
        assert!(report.message.contains("zone b is full"), "{}", report.message);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["kind"], "zone-unavailable");
        assert!(json.get("instance").is_none(), "{json}");

        let unknown = BrokerServiceError::UnknownInstance("i-1".into()).report().about_instance("ignored");
        assert_eq!((unknown.kind, unknown.instance.as_deref()), (ErrorKind::UnknownInstance, Some("i-1")));
    }

    #[test]
    fn an_anyhow_chain_is_reported_by_its_first_known_error() {
        let call = CallError::Busy {
            provider: "kvm".into(),
            method: Method::StopInstances,
            limit: 4,
            waited: std::time::Duration::from_secs(1),
        };
        let err = anyhow::Error::from(call).context("stopping i-1");
        let report = ErrorReport::of_chain(err.chain(), format!("{err:#}"));
        assert_eq!(report.kind, ErrorKind::Busy);
        assert!(report.message.starts_with("stopping i-1: provider kvm"), "{}", report.message);
        let plain = anyhow::anyhow!("cannot read spec.json");
        assert_eq!(ErrorReport::of_chain(plain.chain(), plain.to_string()).kind, ErrorKind::Other);
    }
}
