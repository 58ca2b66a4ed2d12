//! Who answers the CLI: the daemon serving on the data dir if one is, else
//! the broker opened in this process. Both give the same records, so the
//! commands print the same either way.

use crate::client::{DaemonClient, encode_component};
use anyhow::{Context, Result};
use broker_capabilities::rooms::context::{CallEvent, CallHooks};
use broker_core::broker::Broker;
use broker_core::providers::registry::SwapReport;
use broker_core::providers::view::ProviderView;
use broker_core::store::{Event, InstanceRecord, ProviderRecord};
use http::Method;
use serde_json::json;
use std::path::Path;

/// How long a command waits for the state file another broker process holds.
const STATE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) enum Backend {
    Embedded(std::sync::Arc<Broker>),
    Daemon(DaemonClient),
}

/// A start as the CLI asks for it.
pub(crate) struct StartRequest<'a> {
    pub(crate) provider: &'a str,
    /// Juju's syntax, already parsed once by the caller to catch usage errors.
    pub(crate) constraints: &'a str,
    pub(crate) placement: Option<&'a str>,
    pub(crate) user_data: Option<Vec<u8>>,
    pub(crate) tags: Vec<(String, String)>,
    /// `StartInstanceParams` as JSON.
    pub(crate) params: Option<serde_json::Value>,
}

impl StartRequest<'_> {
    /// What the host builds the start's params from.
    pub(crate) fn input(&self) -> broker_capabilities::contract::start::StartInput<'_> {
        broker_capabilities::contract::start::StartInput {
            params: self.params.as_ref(),
            constraints: self.constraints,
            placement: self.placement,
            user_data: self.user_data.clone(),
            tags: &self.tags,
        }
    }
}

impl Backend {
    /// The daemon on `socket` if one answers there, else the state in `data_dir`.
    pub(crate) async fn open(data_dir: &Path, socket: &Path) -> Result<Backend> {
        if let Some(client) = DaemonClient::probe(socket).await {
            tracing::debug!(socket = %socket.display(), "talking to the broker daemon");
            return Ok(Backend::Daemon(client));
        }
        // Another process holding the state (a daemon starting, or another
        // command) is waited for a while; a daemon that comes up is talked to.
        let mut came_up = None;
        let opened = Broker::open_when_free(data_dir, STATE_PATIENCE, async || {
            came_up = DaemonClient::probe(socket).await;
            came_up.is_none()
        })
        .await;
        if let Some(client) = came_up {
            return Ok(Backend::Daemon(client));
        }
        let broker = opened.with_context(|| format!("cannot open the broker state in {}", data_dir.display()))?;
        Ok(Backend::Embedded(std::sync::Arc::new(broker)))
    }

    pub(crate) async fn add_provider(&self, manifest: &Path) -> Result<ProviderRecord> {
        match self {
            Backend::Embedded(broker) => Ok(broker.registry().add(manifest).await?),
            Backend::Daemon(client) => {
                // The daemon may run elsewhere in the tree: give it an absolute path.
                let manifest = absolute(manifest)?;
                Ok(client.call(Method::POST, "/v1/providers", Some(json!({ "manifest": manifest }))).await?)
            }
        }
    }

    pub(crate) async fn list_providers(&self) -> Result<Vec<ProviderRecord>> {
        match self {
            Backend::Embedded(broker) => Ok(broker.registry().list_shown()?),
            Backend::Daemon(client) => Ok(client.call(Method::GET, "/v1/providers", None).await?),
        }
    }

    pub(crate) async fn show_provider(&self, name: &str) -> Result<ProviderView> {
        match self {
            Backend::Embedded(broker) => {
                let (record, manifest) = broker.registry().show(name)?;
                Ok(ProviderView::new(&record, &manifest))
            }
            Backend::Daemon(client) => {
                Ok(client.call(Method::GET, &format!("/v1/providers/{}", encode_component(name)), None).await?)
            }
        }
    }

    /// `provider call` on a registered provider: its answer as JSON.
    pub(crate) async fn call_provider(
        &self,
        name: &str,
        method: broker_core::manifest::Method,
        params: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value> {
        match self {
            Backend::Embedded(broker) => Ok(broker.call_provider(name, method, params).await?),
            Backend::Daemon(client) => {
                let path = format!("/v1/providers/{}/call", encode_component(name));
                let body = json!({ "method": method.name(), "params": params });
                #[derive(serde::Deserialize)]
                struct Answered {
                    answer: serde_json::Value,
                }
                let answered: Answered = client.call(Method::POST, &path, Some(body)).await?;
                Ok(answered.answer)
            }
        }
    }

    pub(crate) async fn remove_provider(&self, name: &str) -> Result<()> {
        match self {
            Backend::Embedded(broker) => Ok(broker.registry().remove(name).await?),
            Backend::Daemon(client) => {
                let path = format!("/v1/providers/{}", encode_component(name));
                client.call::<serde_json::Value>(Method::DELETE, &path, None).await?;
                Ok(())
            }
        }
    }

    pub(crate) async fn swap(&self, name: &str, component: &Path, check: bool) -> Result<SwapReport> {
        match self {
            Backend::Embedded(broker) => {
                let kit = broker_core::conformance::ConformanceCheck;
                Ok(broker.registry().swap(name, component, check.then_some(&kit as _)).await?)
            }
            Backend::Daemon(client) => {
                let path = format!("/v1/providers/{}/swap", encode_component(name));
                let body = json!({ "component": absolute(component)?, "check": check });
                Ok(client.call(Method::POST, &path, Some(body)).await?)
            }
        }
    }

    pub(crate) async fn start_instance(
        &self,
        request: &StartRequest<'_>,
        on_event: impl Fn(CallEvent) + Send + Sync + 'static,
    ) -> Result<InstanceRecord> {
        match self {
            Backend::Embedded(broker) => {
                let params = broker_capabilities::contract::start::start_params(request.input())?;
                let hooks = CallHooks::with_events(on_event);
                Ok(broker.start_instance(request.provider, &params, &hooks).await?)
            }
            Backend::Daemon(client) => {
                let user_data = match &request.user_data {
                    None => None,
                    Some(bytes) => Some(
                        String::from_utf8(bytes.clone())
                            .map_err(|_| anyhow::anyhow!("the daemon takes user data as UTF-8 text"))?,
                    ),
                };
                let tags: serde_json::Map<String, serde_json::Value> =
                    request.tags.iter().map(|(k, v)| (k.clone(), serde_json::Value::from(v.as_str()))).collect();
                let body = json!({
                    "provider": request.provider,
                    "constraints": request.constraints,
                    "placement": request.placement,
                    "user_data": user_data,
                    "tags": tags,
                    "params": request.params,
                });
                Ok(client.start_instance(body, on_event).await?)
            }
        }
    }

    /// The instances of `provider` (or of all). One that cannot answer is
    /// listed as the listing of all lists it: its records, `unknown`, with
    /// why (an operator still sees what the host holds; a provider the host
    /// does not have stays an error).
    pub(crate) async fn list_instances(&self, provider: Option<&str>) -> Result<Vec<InstanceRecord>> {
        let answered = self.listing(provider).await;
        match (provider, answered) {
            (Some(name), Err(failed)) if could_not_answer(&failed) => {
                let all = self.listing(None).await?;
                Ok(all.into_iter().filter(|record| record.provider == name).collect())
            }
            (_, answered) => answered,
        }
    }

    async fn listing(&self, provider: Option<&str>) -> Result<Vec<InstanceRecord>> {
        match self {
            Backend::Embedded(broker) => Ok(broker.list_instances(provider).await?),
            Backend::Daemon(client) => {
                let path = match provider {
                    Some(p) => format!("/v1/instances?provider={}", encode_component(p)),
                    None => "/v1/instances".to_owned(),
                };
                Ok(client.call(Method::GET, &path, None).await?)
            }
        }
    }

    /// Stop `ids` (through `provider`, or each through the one the host recorded
    /// it for); returns each provider asked with the ids it stopped.
    pub(crate) async fn stop_instances(&self, ids: Vec<String>, provider: Option<&str>) -> StopReport {
        let mut report = StopReport::default();
        match self {
            Backend::Embedded(broker) => {
                let mut by_provider: Vec<(String, Vec<String>)> = Vec::new();
                for id in ids {
                    let owner = match provider {
                        Some(p) => p.to_owned(),
                        None => match broker.owner_for_stop(&id).await {
                            Ok(Some(owner)) => owner,
                            Ok(None) => {
                                report.unknown.push(id);
                                continue;
                            }
                            Err(failed) => {
                                report.failed.push((id.clone(), anyhow::Error::new(failed)));
                                continue;
                            }
                        },
                    };
                    match by_provider.iter_mut().find(|(p, _)| *p == owner) {
                        Some((_, list)) => list.push(id),
                        None => by_provider.push((owner, vec![id])),
                    }
                }
                // One call per provider, with all its ids, as Juju's StopInstances takes them.
                for (owner, ids) in by_provider {
                    match broker.stop_instances(&owner, &ids).await {
                        Ok(()) => report.stopped.extend(ids.into_iter().map(|id| (id, owner.clone()))),
                        Err(failed) => report.failed.push((ids.join(" "), anyhow::Error::new(failed))),
                    }
                }
            }
            Backend::Daemon(client) => {
                // The daemon finds each id's provider; its answer says which, or that it knows no such id.
                for id in ids {
                    let path = format!("/v1/instances/{}{}", encode_component(&id), provider_query(provider));
                    match client.call::<Stopped>(Method::DELETE, &path, None).await {
                        Ok(Stopped { provider: Some(owner), stopped: true }) => report.stopped.push((id, owner)),
                        Ok(_) => report.unknown.push(id),
                        Err(failed) => report.failed.push((id, failed.into())),
                    }
                }
            }
        }
        report
    }

    /// Run `maintain-instance`; returns the provider that did.
    pub(crate) async fn maintain_instance(&self, id: &str, provider: Option<&str>) -> Result<String> {
        match self {
            Backend::Embedded(broker) => {
                let owner = match provider {
                    Some(p) => p.to_owned(),
                    None => broker.provider_of(id)?,
                };
                broker.maintain_instance(&owner, id).await?;
                Ok(owner)
            }
            Backend::Daemon(client) => {
                let path = format!("/v1/instances/{}/maintain{}", encode_component(id), provider_query(provider));
                Ok(client.call::<Owner>(Method::POST, &path, None).await?.provider)
            }
        }
    }

    pub(crate) async fn events(&self, after: u64, limit: usize) -> Result<Vec<Event>> {
        match self {
            Backend::Embedded(broker) => Ok(broker.store().events(after, limit)?),
            Backend::Daemon(client) => {
                Ok(client.call(Method::GET, &format!("/v1/events?after={after}&limit={limit}"), None).await?)
            }
        }
    }
}

/// The provider that answered a stop or maintain, as the daemon reports it.
#[derive(serde::Deserialize)]
struct Owner {
    provider: String,
}

/// The daemon's answer to a stop: `stopped` is false for an id it has no record of.
#[derive(serde::Deserialize)]
struct Stopped {
    provider: Option<String>,
    stopped: bool,
}

/// What `instance stop` did with each id: stopped (with its provider), not
/// known to the host (nothing to stop), or failed (the ids of one call, and why).
#[derive(Default)]
pub(crate) struct StopReport {
    pub(crate) stopped: Vec<(String, String)>,
    pub(crate) unknown: Vec<String>,
    pub(crate) failed: Vec<(String, anyhow::Error)>,
}

fn provider_query(provider: Option<&str>) -> String {
    provider.map(|p| format!("?provider={}", encode_component(p))).unwrap_or_default()
}

fn absolute(path: &Path) -> Result<std::path::PathBuf> {
    std::path::absolute(path).with_context(|| format!("cannot resolve {}", path.display()))
}

/// Whether a listing failed because the provider could not answer (a trap, a
/// deadline, a limit, busy, half-open), not because the host has no such
/// provider or is removing it.
fn could_not_answer(failed: &anyhow::Error) -> bool {
    use broker_core::broker::BrokerServiceError;
    if let Some(refused) = failed.downcast_ref::<crate::client::ClientError>() {
        // The daemon's 502 (the provider failed) and 503 (busy, half-open).
        return matches!(refused, crate::client::ClientError::Refused { status: 502..=504, .. });
    }
    matches!(failed.downcast_ref::<BrokerServiceError>(), Some(BrokerServiceError::Call(_)))
}
