//! `broker:provider/process`: granted programs only, no shell, capped output,
//! process-group kills, and long-running children that survive the host.
//! The grant is checked here; what the call then reaches is a backend
//! ([`ProcessBackend`]): the host's programs ([`HostProcesses`]), a simulated
//! process table for the conformance kit ([`simulated`]), or either with every
//! call written down ([`Recorded`], [`tape`]).

mod backend;
mod children;
mod on_host;
mod policy;
pub mod simulated;
pub mod tape;

pub use backend::{Launch, ProcessBackend, Recorded};
pub use children::{ChildRecord, ChildRecords, LiveChildren, Liveness, MemoryChildRecords, RecordsError, proc_stat};
pub use on_host::{HostProcesses, MAX_OUTPUT_BYTES};
pub use policy::{GUEST_DATA_DIR, PolicyError, ProcessPolicy};
pub use simulated::SimProcesses;
pub use tape::{ProcessTape, RecordedSockets};

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::process::{self as wit, ChildStatus, Output};
use crate::capabilities::denials::Denials;
use crate::capabilities::view::{View, ViewOf};
use nix::sys::signal::Signal;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Linker, Resource};

/// Its interface in the contract package.
pub const INTERFACE: &str = "process";

/// The host object behind a guest's `child` handle.
pub struct HeldChild {
    record: ChildRecord,
}

pub struct ProcessCtx {
    provider: String,
    /// `None` when the manifest grants no programs.
    policy: Option<Arc<ProcessPolicy>>,
    backend: Arc<dyn ProcessBackend>,
    denials: Denials,
}

impl ProcessCtx {
    pub fn new(
        provider: &str,
        policy: Option<Arc<ProcessPolicy>>,
        backend: Arc<dyn ProcessBackend>,
        denials: Denials,
    ) -> Self {
        ProcessCtx { provider: provider.to_owned(), policy, backend, denials }
    }

    fn policy(&self) -> Result<&ProcessPolicy, BrokerError> {
        self.policy.as_deref().ok_or_else(|| {
            BrokerError::AccessDenied(
                "process is not granted: list programs in `process = [...]` under [grants]".into(),
            )
        })
    }
}

fn denied(err: PolicyError) -> BrokerError {
    BrokerError::AccessDenied(err.to_string())
}

fn translate_all(policy: &ProcessPolicy, args: &[String]) -> Result<Vec<String>, BrokerError> {
    args.iter().map(|a| policy.translate(a).map_err(denied)).collect()
}

fn translate_env(policy: &ProcessPolicy, env: &[(String, String)]) -> Result<Vec<(String, String)>, BrokerError> {
    policy.check_env(env).map_err(|e| BrokerError::AccessDenied(e.to_string()))?;
    env.iter().map(|(k, v)| Ok((k.clone(), policy.translate(v).map_err(denied)?))).collect()
}

fn status_of(liveness: Liveness) -> ChildStatus {
    match liveness {
        Liveness::Running => ChildStatus::Running,
        Liveness::Exited(code) => ChildStatus::Exited(code),
        Liveness::Signalled(signal) => ChildStatus::Signalled(signal),
        Liveness::Gone => ChildStatus::Gone,
    }
}

fn valid_child_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A call checked against the grant, in host terms: what a backend is handed.
struct Checked {
    path: std::path::PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Checked {
    fn launch<'a>(
        &'a self,
        ctx: &'a ProcessCtx,
        policy: &'a ProcessPolicy,
        program: &'a str,
        guest_args: &'a [String],
    ) -> Launch<'a> {
        Launch {
            provider: &ctx.provider,
            program,
            guest_args,
            path: &self.path,
            args: &self.args,
            env: &self.env,
            policy,
        }
    }
}

impl ProcessCtx {
    fn check(
        &self,
        program: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> Result<(&ProcessPolicy, Checked), BrokerError> {
        let policy = self.policy()?;
        let path = policy.program(program).map_err(denied)?;
        let args = translate_all(policy, args)?;
        let env = translate_env(policy, env)?;
        Ok((policy, Checked { path, args, env }))
    }

    async fn run(
        &self,
        program: &str,
        guest_args: &[String],
        env: &[(String, String)],
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> Result<Output, BrokerError> {
        let (policy, checked) = self.check(program, guest_args, env)?;
        self.backend.run(checked.launch(self, policy, program, guest_args), stdin, timeout_ms).await
    }

    async fn spawn(
        &self,
        name: &str,
        program: &str,
        guest_args: &[String],
        env: &[(String, String)],
    ) -> Result<ChildRecord, BrokerError> {
        self.policy()?;
        if !valid_child_name(name) {
            return Err(BrokerError::InvalidParams(format!(
                "child name {name:?} must be 1-64 letters, digits, '-', '_' or '.'"
            )));
        }
        let (policy, checked) = self.check(program, guest_args, env)?;
        self.backend.spawn(checked.launch(self, policy, program, guest_args), name).await
    }

    async fn adopt(&self, name: &str) -> Result<Option<ChildRecord>, BrokerError> {
        self.policy()?;
        self.backend.adopt(&self.provider, name).await
    }

    fn signal(&self, record: &ChildRecord, signal: Signal) -> Result<(), BrokerError> {
        // Only the very process we started: pid and start time must both match.
        if self.backend.liveness(record) != Liveness::Running {
            return Err(BrokerError::NotFound(format!("child {:?} is not running", record.name)));
        }
        self.backend.signal(record, signal)
    }
}

pub type ProcessView<'a> = View<'a, ProcessCtx>;

impl ProcessView<'_> {
    fn hold(&mut self, record: ChildRecord) -> wasmtime::Result<Resource<HeldChild>> {
        Ok(self.table.push(HeldChild { record })?)
    }

    fn record(&self, handle: &Resource<HeldChild>) -> wasmtime::Result<ChildRecord> {
        Ok(self.table.get(handle)?.record.clone())
    }
}

impl wit::Host for ProcessView<'_> {
    async fn run(
        &mut self,
        program: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> wasmtime::Result<Result<Output, BrokerError>> {
        let ran = self.ctx.run(&program, &args, &env, stdin, timeout_ms).await;
        Ok(ran.map_err(|e| self.ctx.denials.refuse("process", e)))
    }

    async fn spawn(
        &mut self,
        name: String,
        program: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<Resource<HeldChild>, BrokerError>> {
        match self.ctx.spawn(&name, &program, &args, &env).await {
            Ok(record) => Ok(Ok(self.hold(record)?)),
            Err(e) => Ok(Err(self.ctx.denials.refuse("process", e))),
        }
    }

    async fn adopt(&mut self, name: String) -> wasmtime::Result<Result<Option<Resource<HeldChild>>, BrokerError>> {
        match self.ctx.adopt(&name).await {
            Ok(Some(record)) => Ok(Ok(Some(self.hold(record)?))),
            Ok(None) => Ok(Ok(None)),
            Err(e) => Ok(Err(self.ctx.denials.refuse("process", e))),
        }
    }

    async fn children(&mut self) -> wasmtime::Result<Vec<String>> {
        if self.ctx.policy.is_none() {
            return Ok(Vec::new());
        }
        match self.ctx.backend.children(&self.ctx.provider) {
            Ok(names) => Ok(names),
            Err(e) => {
                tracing::warn!(provider = %self.ctx.provider, error = %e, "cannot list child records");
                Ok(Vec::new())
            }
        }
    }
}

impl wit::HostChild for ProcessView<'_> {
    async fn name(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<String> {
        Ok(self.record(&handle)?.name)
    }

    async fn pid(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<u32> {
        Ok(self.record(&handle)?.pid)
    }

    async fn status(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<ChildStatus> {
        let record = self.record(&handle)?;
        Ok(status_of(self.ctx.backend.liveness(&record)))
    }

    async fn signal(&mut self, handle: Resource<HeldChild>, signal: i32) -> wasmtime::Result<Result<(), BrokerError>> {
        let record = self.record(&handle)?;
        let Ok(signal) = Signal::try_from(signal) else {
            return Ok(Err(BrokerError::InvalidParams(format!("{signal} is not a signal"))));
        };
        Ok(self.ctx.signal(&record, signal))
    }

    async fn wait(&mut self, handle: Resource<HeldChild>, timeout_ms: u64) -> wasmtime::Result<ChildStatus> {
        let record = self.record(&handle)?;
        Ok(status_of(self.ctx.backend.wait(&record, Duration::from_millis(timeout_ms)).await))
    }

    async fn forget(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<()> {
        let record = self.record(&handle)?;
        self.ctx.backend.forget(&record).await;
        Ok(())
    }

    async fn drop(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<()> {
        // The child keeps running: it belongs to the host's records, not to the handle.
        self.table.delete(handle)?;
        Ok(())
    }
}

pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> ProcessView<'_>,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, ViewOf<ProcessCtx>>(linker, getter)
}
