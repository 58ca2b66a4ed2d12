//! Host calls refused for want of a grant. Each is logged where it happens;
//! the conformance kit also collects them, so a provider that swallows the
//! refusal and carries on is still caught calling what it was not granted.

use crate::bindings::BrokerError;
use crate::quotas::Quotas;
use std::sync::{Arc, Mutex};

/// Where a store's refusals go. Cheap to clone; collects nothing by default.
#[derive(Clone, Default)]
pub struct Denials {
    provider: Arc<str>,
    collected: Option<Arc<Mutex<Vec<String>>>>,
    /// The provider's log rate, which its refusals' warnings count against.
    quotas: Option<Arc<Quotas>>,
    /// Hides the provider's secrets in what a refusal quotes of its request.
    redactor: Arc<crate::secrets::Redactor>,
}

impl Denials {
    /// Denials that keep every refusal, and the list they keep them in.
    pub fn collecting() -> (Denials, Arc<Mutex<Vec<String>>>) {
        let collected = Arc::new(Mutex::new(Vec::new()));
        let denials =
            Denials { provider: "".into(), collected: Some(collected.clone()), quotas: None, redactor: Arc::default() };
        (denials, collected)
    }

    /// The same destination, for one provider's stores; its warnings count
    /// against the provider's log rate (a guest can make refusals in a loop).
    pub fn for_provider(&self, provider: Arc<str>, quotas: Arc<Quotas>) -> Denials {
        Denials { provider, collected: self.collected.clone(), quotas: Some(quotas), redactor: self.redactor.clone() }
    }

    /// The same, hiding `redactor`'s secrets in what a refusal quotes.
    pub fn redacting(mut self, redactor: Arc<crate::secrets::Redactor>) -> Denials {
        self.redactor = redactor;
        self
    }

    /// Pass `error` on to the guest, noting it first if it is a refusal.
    pub fn refuse(&self, interface: &str, error: BrokerError) -> BrokerError {
        if let BrokerError::AccessDenied(message) = &error {
            self.note(interface, message);
        }
        error
    }

    /// Whether one more line of the provider's may be logged now (its log
    /// rate): for what a guest can make the host log in a loop.
    pub(crate) fn log_allowed(&self) -> bool {
        match &self.quotas {
            Some(quotas) => quotas.log_line_allowed(&self.provider),
            None => true,
        }
    }

    /// Note a refusal that was not a host call's answer (a WASI call the host turned away).
    pub fn note(&self, interface: &str, message: &str) {
        let message = &*self.redactor.redact(message);
        if self.log_allowed() {
            tracing::warn!(provider = &*self.provider, interface, reason = message, "host call refused: not granted");
        }
        if let Some(collected) = &self.collected {
            collected.lock().unwrap_or_else(|p| p.into_inner()).push(format!("{interface}: {message}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_refusals_are_collected() {
        let (denials, collected) = Denials::collecting();
        let passed = denials.refuse("process", BrokerError::NotFound("x".into()));
        assert!(matches!(passed, BrokerError::NotFound(_)));
        let refused = denials.refuse("process", BrokerError::AccessDenied("not granted".into()));
        assert!(matches!(refused, BrokerError::AccessDenied(_)));
        assert_eq!(*collected.lock().unwrap(), ["process: not granted"]);
        Denials::default().note("kv", "nothing collects this");
    }

    #[test]
    fn a_providers_refusal_warnings_count_against_its_log_rate() {
        let quotas = Arc::new(Quotas::new(Quotas::default().kv(), 0));
        let (collecting, collected) = Denials::collecting();
        let denials = collecting.for_provider("p".into(), quotas.clone());
        for _ in 0..5 {
            denials.refuse("process", BrokerError::AccessDenied("not granted".into()));
        }
        // Every refusal still reaches the kit; none of the five warnings was written.
        assert_eq!(collected.lock().unwrap().len(), 5);
        assert_eq!(quotas.count(crate::quotas::Quota::LogLines), 5);
    }
}
