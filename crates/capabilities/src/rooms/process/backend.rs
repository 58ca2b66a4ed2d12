//! What granted process calls reach, as one trait: the host's programs and
//! children ([`super::HostProcesses`]), a simulated process table for the
//! conformance kit ([`super::SimProcesses`]), or either of them with every
//! call written to a tape ([`Recorded`]). The grant is checked and the
//! arguments translated before a backend is reached, the same for all; the
//! capability never asks which backend it has.

use super::children::{ChildRecord, Liveness, RecordsError};
use super::policy::ProcessPolicy;
use super::tape::ProcessTape;
use crate::bindings::BrokerError;
use crate::bindings::broker::provider::process::Output;
use futures_util::future::BoxFuture;
use nix::sys::signal::Signal;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// One granted program call, checked: what the provider wrote, and what the host will run.
#[derive(Clone, Copy)]
pub struct Launch<'a> {
    /// The provider making the call.
    pub provider: &'a str,
    /// The granted name, as the provider asked for it (what scripts and tapes hold).
    pub program: &'a str,
    /// The arguments as the provider wrote them (`/data/...`).
    pub(crate) guest_args: &'a [String],
    /// The program on the host, and the arguments and environment in host paths.
    pub path: &'a Path,
    /// Translated to host paths.
    pub args: &'a [String],
    /// Values translated to host paths.
    pub env: &'a [(String, String)],
    /// The grant it was checked against, with its confinement.
    pub policy: &'a ProcessPolicy,
}

/// Programs and children, as the process capability needs them.
pub trait ProcessBackend: Send + Sync + 'static {
    /// Whether granted programs really run here, so they are looked up on the
    /// host and confined when a provider loads (a simulation only names them).
    fn runs_programs(&self) -> bool;

    /// Run to the end (or the timeout, `0` for none) with `stdin`, output capped.
    fn run<'a>(
        &'a self,
        launch: Launch<'a>,
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> BoxFuture<'a, Result<Output, BrokerError>>;

    /// Start a long-running child under `name` (already checked to be a valid name).
    fn spawn<'a>(&'a self, launch: Launch<'a>, name: &'a str) -> BoxFuture<'a, Result<ChildRecord, BrokerError>>;

    /// The child recorded under `name`, unless it is gone for good (then it is forgotten).
    fn adopt<'a>(&'a self, provider: &'a str, name: &'a str)
    -> BoxFuture<'a, Result<Option<ChildRecord>, BrokerError>>;

    /// How the child is doing now.
    fn liveness(&self, record: &ChildRecord) -> Liveness;

    /// Wait up to `timeout` for a running child to end; its state then.
    fn wait<'a>(&'a self, record: &'a ChildRecord, timeout: Duration) -> BoxFuture<'a, Liveness>;

    /// Signal the child's process group (the child is running: checked before).
    fn signal(&self, record: &ChildRecord, signal: Signal) -> Result<(), BrokerError>;

    /// Drop the host's record of the child; it is not signalled.
    fn forget<'a>(&'a self, record: &'a ChildRecord) -> BoxFuture<'a, ()>;

    /// The names of `provider`'s recorded children.
    fn children(&self, provider: &str) -> Result<Vec<String>, RecordsError>;
}

/// Any process backend, with every run, spawn, signal and observed end written
/// to a tape, so a real run becomes a script the simulation replays.
pub struct Recorded<B> {
    inner: B,
    tape: Arc<ProcessTape>,
}

impl<B: ProcessBackend> Recorded<B> {
    /// `inner`, each exchange written to `tape`.
    pub fn new(inner: B, tape: Arc<ProcessTape>) -> Self {
        Recorded { inner, tape }
    }
}

impl<B: ProcessBackend> ProcessBackend for Recorded<B> {
    fn runs_programs(&self) -> bool {
        self.inner.runs_programs()
    }

    fn run<'a>(
        &'a self,
        launch: Launch<'a>,
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> BoxFuture<'a, Result<Output, BrokerError>> {
        Box::pin(async move {
            let output = self.inner.run(launch, stdin, timeout_ms).await;
            if let Ok(output) = &output {
                self.tape.ran(launch.program, launch.guest_args, output);
            }
            output
        })
    }

    fn spawn<'a>(&'a self, launch: Launch<'a>, name: &'a str) -> BoxFuture<'a, Result<ChildRecord, BrokerError>> {
        Box::pin(async move {
            let record = self.inner.spawn(launch, name).await?;
            self.tape.spawned(&record, launch.program, launch.guest_args);
            Ok(record)
        })
    }

    fn adopt<'a>(
        &'a self,
        provider: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ChildRecord>, BrokerError>> {
        Box::pin(async move {
            let adopted = self.inner.adopt(provider, name).await?;
            if let Some(record) = &adopted {
                self.tape.observed(record, self.inner.liveness(record));
            }
            Ok(adopted)
        })
    }

    fn liveness(&self, record: &ChildRecord) -> Liveness {
        let liveness = self.inner.liveness(record);
        self.tape.observed(record, liveness);
        liveness
    }

    fn wait<'a>(&'a self, record: &'a ChildRecord, timeout: Duration) -> BoxFuture<'a, Liveness> {
        Box::pin(async move {
            let liveness = self.inner.wait(record, timeout).await;
            self.tape.observed(record, liveness);
            liveness
        })
    }

    fn signal(&self, record: &ChildRecord, signal: Signal) -> Result<(), BrokerError> {
        self.tape.signalled(record);
        self.inner.signal(record, signal)
    }

    fn forget<'a>(&'a self, record: &'a ChildRecord) -> BoxFuture<'a, ()> {
        self.inner.forget(record)
    }

    fn children(&self, provider: &str) -> Result<Vec<String>, RecordsError> {
        self.inner.children(provider)
    }
}
