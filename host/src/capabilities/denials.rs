//! Host calls refused for want of a grant. Each is logged where it happens;
//! the conformance kit also collects them, so a provider that swallows the
//! refusal and carries on is still caught calling what it was not granted.

use crate::bindings::BrokerError;
use std::sync::{Arc, Mutex};

/// Where a store's refusals go. Cheap to clone; collects nothing by default.
#[derive(Clone, Default)]
pub struct Denials {
    provider: Arc<str>,
    collected: Option<Arc<Mutex<Vec<String>>>>,
}

impl Denials {
    /// Denials that keep every refusal, and the list they keep them in.
    pub fn collecting() -> (Denials, Arc<Mutex<Vec<String>>>) {
        let collected = Arc::new(Mutex::new(Vec::new()));
        (Denials { provider: "".into(), collected: Some(collected.clone()) }, collected)
    }

    /// The same destination, for one provider's stores.
    pub fn for_provider(&self, provider: Arc<str>) -> Denials {
        Denials { provider, collected: self.collected.clone() }
    }

    /// Pass `error` on to the guest, noting it first if it is a refusal.
    pub fn refuse(&self, interface: &str, error: BrokerError) -> BrokerError {
        if let BrokerError::AccessDenied(message) = &error {
            self.note(interface, message);
        }
        error
    }

    pub(crate) fn note(&self, interface: &str, message: &str) {
        tracing::warn!(provider = &*self.provider, interface, reason = message, "host call refused: not granted");
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
}
