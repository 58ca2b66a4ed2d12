//! The daemon, composed: the one place `broker serve` is put together (the
//! state opened, what a crash left behind dealt with, the providers directory
//! watched, the API and InfraKit's sockets served, all of it stopped in order).

use super::{ServeLimits, Serving};
use anyhow::{Context, Result};
use broker_core::broker::Broker;
use std::path::{Path, PathBuf};

/// How often `broker serve` ends processes of its providers' users that no
/// child record holds (and how old such a process must be).
const REAP_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// What `broker serve` is asked to do, its usage already checked.
pub(crate) struct DaemonOptions {
    /// The manifests directory watched for providers.
    pub(crate) providers_dir: PathBuf,
    /// The most kv held in memory across providers.
    pub(crate) kv_mirror_bytes: usize,
    /// The bounds on each connection and request, and the drain.
    pub(crate) limits: ServeLimits,
    /// What to do with instances a provider reports that no record has.
    pub(crate) harvest: broker_core::broker::reconcile::HarvestMode,
    /// What is served besides the unix socket, and the groups' settings.
    pub(crate) serving: Serving,
}

/// Run the daemon on `data_dir`, its API on `socket`, until SIGTERM or SIGINT.
pub(crate) async fn run(data_dir: &Path, socket: &Path, options: DaemonOptions) -> Result<()> {
    let DaemonOptions { providers_dir, kv_mirror_bytes, limits, harvest, serving } = options;
    let providers_dir = providers_dir.as_path();
    // A CLI command working on the state itself (no daemon was serving when it
    // began) is let finish: a supervisor's restart racing it does not fail.
    let patience = std::time::Duration::from_secs(30);
    let broker = Broker::open_when_free(data_dir, patience, async || true)
        .await
        .with_context(|| format!("cannot open the broker state in {}", data_dir.display()))?;
    broker.store().kv().set_mirror_budget(kv_mirror_bytes);
    let watched = broker_core::providers::watch::ProvidersDir::new(providers_dir)
        .with_context(|| format!("cannot watch the providers directory {}", providers_dir.display()))?;
    let broker = std::sync::Arc::new(broker);
    // Juju's agent maintains its instances when it starts; here that runs
    // beside the API, and each provider's result is an event. Held first, so
    // no start the API takes can be harvested as unknown.
    broker.hold_starts_for_harvest(harvest);
    // Before any provider runs: what a killed host spawned but never recorded.
    let reaped = broker.reap_unrecorded_children();
    if !reaped.is_empty() {
        tracing::warn!(count = reaped.len(), "killed processes left running without a child record");
    }
    broker.prune_stale_device_records().await;
    let reconciling = broker.clone();
    tokio::spawn(async move { reconciling.reconcile_after_restart(harvest).await });

    let (stop, stopping) = tokio::sync::watch::channel(false);
    let until_stopping = |mut stopping: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    // And while it runs: what a program left behind outside every record (its
    // record was forgotten, its sandbox escaped the group) does not live on.
    let reaping = broker.clone();
    let reap_stop = until_stopping(stopping.clone());
    let reaper = tokio::spawn(async move {
        tokio::pin!(reap_stop);
        let mut every = tokio::time::interval(REAP_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = &mut reap_stop => return,
            }
            let broker = reaping.clone();
            let reaped = tokio::task::spawn_blocking(move || broker.reap_unrecorded_older_than(REAP_EVERY))
                .await
                .unwrap_or_default();
            if !reaped.is_empty() {
                tracing::warn!(count = reaped.len(), "killed processes running without a child record");
            }
        }
    });
    let watching = broker.clone();
    let watch_stop = until_stopping(stopping.clone());
    let watcher = tokio::spawn(async move {
        let (settle, poll) = (std::time::Duration::from_millis(200), std::time::Duration::from_secs(2));
        broker_core::providers::watch::watch(watched, watching.registry(), settle, poll, watch_stop).await;
    });
    let stop = std::sync::Arc::new(stop);
    let signalled = stop.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = signalled.send(true);
    });
    let served = super::serve(broker, socket, serving, limits, until_stopping(stopping)).await;
    // Served to the end or failed to start: either way the watcher stops too, and a
    // rescan in progress (a swap, a removal draining) finishes first.
    let _ = stop.send(true);
    // Bounded as the drain is: a rescan's swap queued behind others must not
    // outlast the supervisor's patience.
    if tokio::time::timeout(limits.drain, watcher).await.is_err() {
        tracing::warn!("the providers directory's rescan was still running when the drain ran out");
    }
    // A reap in progress holds the broker: it ends (it is bounded by /proc's size) before the state closes.
    let _ = reaper.await;
    served
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down: no new requests; finishing those in flight");
}
