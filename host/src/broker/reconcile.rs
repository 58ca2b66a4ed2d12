//! Start-up reconcile, as Juju's agent does when it starts: each recorded
//! instance gets `maintain-instance`, and what each provider reports is
//! compared with the host's records. What differs is reported (an event per
//! provider and a log line), never silently changed.

use super::service::Broker;
use crate::capabilities::context::CallHooks;
use crate::store::Event;

/// What a reconcile found for one provider.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Reconciled {
    /// The provider reconciled.
    pub provider: String,
    pub(crate) maintained: Vec<String>,
    /// Instance id and why `maintain-instance` failed.
    pub maintain_failed: Vec<(String, String)>,
    /// Reported by the provider, never recorded by the host.
    pub unknown_to_host: Vec<String>,
    /// Recorded by the host, no longer reported by the provider.
    pub vanished: Vec<String>,
    /// Reported by the provider with an id the host does not take (not a valid
    /// id, or another provider's), escaped, with why; left out of the above.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
    /// The provider could not be asked at all.
    pub error: Option<String>,
}

impl Reconciled {
    /// One line for the `reconciled` event: counts, failures and differences, or why it could not run.
    pub fn summary(&self) -> String {
        if let Some(error) = &self.error {
            return format!("cannot reconcile: {error}");
        }
        let mut parts = vec![format!("maintained {}", self.maintained.len())];
        if !self.maintain_failed.is_empty() {
            let failed = self.maintain_failed.iter().map(|(id, why)| format!("{id} ({why})"));
            parts.push(format!("maintain failed: {}", named(failed)));
        }
        if !self.unknown_to_host.is_empty() {
            parts.push(format!("unknown to the host: {}", named(self.unknown_to_host.iter().cloned())));
        }
        if !self.vanished.is_empty() {
            parts.push(format!("vanished: {}", named(self.vanished.iter().cloned())));
        }
        if !self.refused.is_empty() {
            parts.push(format!("refused ids: {}", named(self.refused.iter().cloned())));
        }
        parts.join("; ")
    }
}

/// `maintain-instance` calls a reconcile runs at once per provider.
const MAINTAIN_AT_ONCE: usize = 8;

/// Ids a `reconciled` event names per kind; past that it counts them.
const IDS_NAMED: usize = 20;

/// `ids`, the first [`IDS_NAMED`] of them, then how many more.
fn named(ids: impl ExactSizeIterator<Item = String>) -> String {
    let count = ids.len();
    let mut text: Vec<String> = ids.take(IDS_NAMED).collect();
    if count > IDS_NAMED {
        text.push(format!("and {} more", count - IDS_NAMED));
    }
    text.join(", ")
}

impl Broker {
    /// Reconcile every registered provider; each result is also an event.
    pub async fn reconcile(&self) -> Vec<Reconciled> {
        let names: Vec<String> = match self.registry().list() {
            Ok(records) => records.into_iter().map(|p| p.name).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list providers to reconcile");
                return Vec::new();
            }
        };
        // All at once, as listing does: a slow or failing provider holds up no other.
        let all = futures_util::future::join_all(names.iter().map(|name| self.reconcile_one(name))).await;
        let mut out = Vec::new();
        for (name, found) in names.into_iter().zip(all) {
            let mut event = Event::new("reconciled", &name);
            event.detail = found.summary();
            if let Err(e) = self.store().append_event(&event).await {
                tracing::warn!(provider = %name, error = %e, "cannot record a reconcile");
            }
            tracing::info!(provider = %name, result = %event.detail, "reconciled");
            out.push(found);
        }
        out
    }

    async fn reconcile_one(&self, name: &str) -> Reconciled {
        use futures_util::StreamExt;
        use std::collections::HashSet;
        let mut found = Reconciled { provider: name.to_owned(), ..Reconciled::default() };
        let before = match self.store().instances(Some(name)) {
            Ok(records) => records,
            Err(e) => return Reconciled { error: Some(e.to_string()), ..found },
        };
        // A few at once: the provider's concurrency bound is shared with the
        // calls the API serves meanwhile, and its own backend has its limits too.
        let ids: Vec<String> = before.iter().map(|r| r.id.clone()).collect();
        let maintained: Vec<_> = futures_util::stream::iter(ids)
            .map(|id: String| async move {
                let outcome = self.maintain_instance(name, &id).await;
                (id, outcome)
            })
            .buffer_unordered(MAINTAIN_AT_ONCE)
            .collect()
            .await;
        for (id, outcome) in maintained {
            match outcome {
                Ok(()) => found.maintained.push(id),
                Err(e) => found.maintain_failed.push((id, e.to_string())),
            }
        }
        found.maintained.sort_unstable();
        found.maintain_failed.sort_unstable();
        let live = match self.registry().get(name).await {
            Ok(wasm) => wasm.all_instances(&CallHooks::default()).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let live = match live.and_then(|live| self.screen_reported(name, live).map_err(|e| e.to_string())) {
            Ok((live, refused)) => {
                found.refused = refused;
                live
            }
            Err(e) => return Reconciled { error: Some(e), ..found },
        };
        // Like with like: the records are read again now the provider has
        // answered. An instance started meanwhile is in both; one stopped
        // meanwhile is in neither the records after nor (likely) the answer.
        let after = match self.store().instances(Some(name)) {
            Ok(records) => records,
            Err(e) => return Reconciled { error: Some(e.to_string()), ..found },
        };
        let recorded_after: HashSet<&str> = after.iter().map(|r| r.id.as_str()).collect();
        let reported: HashSet<&str> = live.iter().map(|i| i.id.as_str()).collect();
        found.unknown_to_host =
            live.iter().filter(|i| !recorded_after.contains(i.id.as_str())).map(|i| i.id.clone()).collect();
        found.vanished = before
            .iter()
            .filter(|r| recorded_after.contains(r.id.as_str()) && !reported.contains(r.id.as_str()))
            .map(|r| r.id.clone())
            .collect();
        found
    }
}
