//! The fake provider's behaviour (Juju's dummy broker), run in both isolation
//! modes: it must be correct whether its wasm instance is reused or fresh.

use broker_capabilities::bindings::*;
use broker_capabilities::contract::constraints;
use broker_capabilities::contract::{empty_params, params_with};
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::{KvBackend, MemoryKv};
use broker_core::version::{CallError, ProviderVersion};
use broker_tests::{fake_manifest_extra, load_provider, runtime};
use std::sync::Arc;

fn fake(isolation: &str) -> (tempfile::TempDir, Arc<MemoryKv>, ProviderVersion) {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let provider = load_provider(&runtime(), kv.clone(), dir.path(), "fake", "fake", &fake_manifest_extra(isolation))
        .expect("load fake");
    (dir, kv, provider)
}

fn in_group(ids: Vec<String>) -> CallHooks {
    CallHooks { distribution_group: Some(Arc::new(move || Ok(ids.clone()))), ..Default::default() }
}

fn ids(instances: &[Instance]) -> Vec<String> {
    instances.iter().map(|i| i.id.clone()).collect()
}

fn zone(result: &StartInstanceResult) -> String {
    result.hardware.as_ref().and_then(|h| h.availability_zone.clone()).unwrap()
}

async fn lifecycle(isolation: &str) {
    let (_dir, kv, provider) = fake(isolation);
    let none = CallHooks::default();
    let describe = provider.describe().await.unwrap();
    assert_eq!(describe.name, "fake");
    assert!(describe.features.contains(&"zones".to_string()));

    // Start three, stop one: all-instances reflects each step (Juju scenario 8).
    let mut started = Vec::new();
    for _ in 0..3 {
        started.push(provider.start_instance(&none, &empty_params()).await.unwrap().instance.id);
    }
    assert_eq!(started, ["fake-0", "fake-1", "fake-2"]);
    assert_eq!(ids(&provider.all_instances(&none).await.unwrap()), started);
    provider.stop_instances(&none, &started[1..2]).await.unwrap();
    assert_eq!(ids(&provider.all_instances(&none).await.unwrap()), ["fake-0", "fake-2"]);

    // Stop is idempotent: again, and for ids that never existed.
    provider.stop_instances(&none, &started[1..2]).await.unwrap();
    provider.stop_instances(&none, &["nope".to_string()]).await.unwrap();
    assert_eq!(provider.all_instances(&none).await.unwrap().len(), 2);

    // Maintain marks the instance; an unknown one is a typed not-found.
    provider.maintain_instance(&none, "fake-0", &empty_params()).await.unwrap();
    let record = fake_logic::decode(&kv.get("fake", "instance/fake-0").unwrap().unwrap()).unwrap();
    assert_eq!(record.maintained, 1);
    let err = provider.maintain_instance(&none, "fake-1", &empty_params()).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::NotFound(_))), "{err}");
}

async fn zones(isolation: &str) {
    let (_dir, _kv, provider) = fake(isolation);
    // The distribution group spreads over the zone with the fewest members.
    let a = provider.start_instance(&in_group(vec![]), &empty_params()).await.unwrap();
    let b = provider.start_instance(&in_group(vec![a.instance.id.clone()]), &empty_params()).await.unwrap();
    let c = provider
        .start_instance(&in_group(vec![a.instance.id.clone(), b.instance.id.clone()]), &empty_params())
        .await
        .unwrap();
    assert_eq!([zone(&a), zone(&b), zone(&c)], ["zone-a", "zone-b", "zone-c"]);

    // A placement directive wins; a zones constraint limits the choice.
    let mut placed = empty_params();
    placed.placement = Some("zone=zone-b".into());
    assert_eq!(zone(&provider.start_instance(&CallHooks::default(), &placed).await.unwrap()), "zone-b");
    let limited = params_with(constraints::parse("zones=zone-c").unwrap());
    assert_eq!(zone(&provider.start_instance(&CallHooks::default(), &limited).await.unwrap()), "zone-c");

    // Errors are typed: a bad directive is invalid-params, no zone at all is zone-independent.
    placed.placement = Some("rack=7".into());
    let err = provider.start_instance(&CallHooks::default(), &placed).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::InvalidParams(_))), "{err}");
    let mars = params_with(constraints::parse("zones=mars").unwrap());
    let err = provider.start_instance(&CallHooks::default(), &mars).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::ZoneIndependent(_))), "{err}");
    assert!(err.to_string().contains("provider fake: start-instance"), "{err}");
}

#[tokio::test]
pub(crate) async fn lifecycle_pooled() {
    lifecycle("pooled").await;
}

#[tokio::test]
async fn lifecycle_per_call() {
    lifecycle("per-call").await;
}

#[tokio::test]
async fn zones_pooled() {
    zones("pooled").await;
}

#[tokio::test]
async fn zones_per_call() {
    zones("per-call").await;
}

#[tokio::test]
async fn aborted_call_is_reported_as_aborted() {
    let (_dir, _kv, provider) = fake("pooled");
    let hooks = CallHooks::default();
    hooks.abort.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = provider.start_instance(&hooks, &empty_params()).await.unwrap_err();
    assert!(matches!(err.broker_error(), Some(BrokerError::Aborted(_))), "{err}");
    assert!(provider.all_instances(&CallHooks::default()).await.unwrap().is_empty(), "nothing was started");
}

#[tokio::test]
async fn validate_config_rejects_garbage_with_invalid_params() {
    let (_dir, _kv, provider) = fake("pooled");
    provider.validate_config(r#"{"zones":["z1"]}"#).await.unwrap();
    for garbage in [r#"{"zones":[]}"#, r#"{"colour":"red"}"#, "not json"] {
        let err = provider.validate_config(garbage).await.unwrap_err();
        assert!(matches!(err, CallError::Guest { error: BrokerError::InvalidParams(_), .. }), "{garbage}: {err}");
    }
}
