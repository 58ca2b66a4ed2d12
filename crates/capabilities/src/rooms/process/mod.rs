//! `broker:provider/process`: granted programs only, no shell, capped output,
//! process-group kills, and long-running children that survive the host.
//! The grant is checked here; what the call then reaches is a backend
//! ([`ProcessBackend`]): the host's programs ([`HostProcesses`]), a simulated
//! process table for the conformance kit ([`simulated`]), or either with every
//! call written down ([`Recorded`], [`tape`]).
//!
//! The room is [`Process`]: its grant spreads over `process`, `paths`,
//! `paths-rw`, `devices` and `env` under `[grants]` ([`ProcessGrant`]); when a
//! provider version loads it looks the programs up and confines them
//! ([`Room::prepare`]: a [`ProcessPolicy`]), which each store's part uses.

mod backend;
mod children;
pub mod kit;
mod on_host;
mod policy;
pub mod simulated;
pub mod tape;

pub use backend::{Launch, ProcessBackend, Recorded};
pub use children::{
    ChildRecord, ChildRecords, LiveChildren, Liveness, MemoryChildRecords, RecordsError, proc_stat, reap_unrecorded,
};
pub use on_host::{HostProcesses, MAX_OUTPUT_BYTES};
pub(crate) use policy::GUEST_DATA_DIR;
pub use policy::{PolicyError, ProcessPolicy};
pub(crate) use simulated::SimProcesses;
pub use tape::ProcessTape;
pub(crate) use tape::RecordedSockets;

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::process::{self as wit, ChildStatus, Output};
use crate::rooms::BoxError;
use crate::rooms::HasRooms;
use crate::rooms::denials::Denials;
use crate::rooms::view::{View, ViewOf};
use crate::rooms::{GrantLine, GrantValue, Linking, LoadSetup, Room, StoreSetup};
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Linker, Resource};

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "process";

/// The host object behind a guest's `child` handle.
pub struct HeldChild {
    record: ChildRecord,
}

/// Per-store context; the default grants nothing and reaches nothing.
#[derive(Default)]
pub struct ProcessCtx {
    provider: String,
    /// `None` when the manifest grants no programs.
    policy: Option<Arc<ProcessPolicy>>,
    /// `None` without the grant, or in a sandbox that gives no programs.
    backend: Option<Arc<dyn ProcessBackend>>,
    denials: Denials,
}

impl ProcessCtx {
    /// `policy` is `None` when no programs are granted; `backend` is `None`
    /// where nothing runs.
    pub fn new(
        provider: &str,
        policy: Option<Arc<ProcessPolicy>>,
        backend: Option<Arc<dyn ProcessBackend>>,
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

    /// What granted calls reach.
    fn backend(&self) -> Result<&Arc<dyn ProcessBackend>, BrokerError> {
        self.backend.as_ref().ok_or_else(|| {
            BrokerError::AccessDenied("process has no backend here: this sandbox runs no programs".into())
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
        // Checked here, for the host and the kit's simulation alike; the host passes the taps when it runs.
        on_host::pass_taps(&args, 3)?;
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
        self.backend()?.run(checked.launch(self, policy, program, guest_args), stdin, timeout_ms).await
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
        self.backend()?.spawn(checked.launch(self, policy, program, guest_args), name).await
    }

    async fn adopt(&self, name: &str) -> Result<Option<ChildRecord>, BrokerError> {
        self.policy()?;
        self.backend()?.adopt(&self.provider, name).await
    }

    fn signal(&self, record: &ChildRecord, signal: Signal) -> Result<(), BrokerError> {
        // Only the very process we started: pid and start time must both match.
        let backend = self.backend()?;
        if backend.liveness(record) != Liveness::Running {
            return Err(BrokerError::NotFound(format!("child {:?} is not running", record.name)));
        }
        backend.signal(record, signal)
    }
}

/// What the process host functions see of a store.
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
        let (Some(_), Some(backend)) = (&self.ctx.policy, &self.ctx.backend) else {
            return Ok(Vec::new());
        };
        match backend.children(&self.ctx.provider) {
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
        Ok(self.ctx.backend.as_ref().map_or(ChildStatus::Gone, |backend| status_of(backend.liveness(&record))))
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
        let Some(backend) = self.ctx.backend.clone() else { return Ok(ChildStatus::Gone) };
        Ok(status_of(backend.wait(&record, Duration::from_millis(timeout_ms)).await))
    }

    async fn forget(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<()> {
        let record = self.record(&handle)?;
        if let Some(backend) = self.ctx.backend.clone() {
            backend.forget(&record).await;
        }
        Ok(())
    }

    async fn drop(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<()> {
        // The child keeps running: it belongs to the host's records, not to the handle.
        self.table.delete(handle)?;
        Ok(())
    }
}

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> ProcessView<'_>,
) -> wasmtime::Result<()> {
    // The same in every contract version served: linked under each one's name.
    for instance in crate::bindings::served_instances(INTERFACE) {
        wit::add_to_linker_instance::<T, ViewOf<ProcessCtx>>(&mut linker.instance(&instance)?, getter)?;
    }
    Ok(())
}

/// The programs a provider may run and what they may reach, as `[grants]`
/// spells it (`process`, `paths`, `paths-rw`, `devices`, `env`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ProcessGrant {
    /// Programs the provider may run (names on the host's PATH, or absolute paths).
    #[serde(default)]
    pub process: Vec<String>,
    /// Host paths (read by granted programs, e.g. base images) that arguments may
    /// name; bound read-only into the programs' sandbox.
    #[serde(default)]
    pub paths: Vec<PathBuf>,
    /// Host paths bound read-write into the programs' sandbox.
    #[serde(default)]
    pub paths_rw: Vec<PathBuf>,
    /// Device nodes the programs may open (`/dev/kvm`, `/dev/net/tun`); the
    /// provider's sandbox user is given read and write on them.
    #[serde(default)]
    pub devices: Vec<PathBuf>,
    /// Environment names the programs may be given besides the base allow-list
    /// (never `LD_*` or the like: refused at load).
    #[serde(default)]
    pub env: Vec<String>,
}

impl GrantValue for ProcessGrant {
    fn granted(&self) -> bool {
        !self.process.is_empty()
    }

    fn widening(&self, approved: &Self, _key: &str) -> Option<String> {
        let new_item = |now: &[String], before: &[String], what: &str| {
            now.iter().find(|item| !before.contains(item)).map(|item| format!("{what} {item:?}"))
        };
        // A path is covered by an approved one it lies under.
        let paths = |now: &[PathBuf], before: &[PathBuf], what: &str| {
            now.iter().find(|p| !before.iter().any(|b| p.starts_with(b))).map(|p| format!("{what} {}", p.display()))
        };
        new_item(&self.process, &approved.process, "process")
            .or_else(|| paths(&self.paths, &[approved.paths.clone(), approved.paths_rw.clone()].concat(), "paths"))
            .or_else(|| paths(&self.paths_rw, &approved.paths_rw, "paths-rw"))
            .or_else(|| paths(&self.devices, &approved.devices, "devices"))
            .or_else(|| new_item(&self.env, &approved.env, "env"))
    }

    fn shown(&self) -> String {
        shown_list(self.process.clone())
    }
}

fn shown_list(items: Vec<String>) -> String {
    if items.is_empty() { "denied".to_owned() } else { items.join(", ") }
}

/// Why a provider's programs cannot be made ready when it loads.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProcessPrepareError {
    /// The granted programs or paths are refused.
    #[error("grants: {}", crate::error_text::cause_text(.0))]
    Grant(PolicyError),
    /// The programs cannot be confined, or the env grant is refused.
    #[error("sandbox: {}", crate::error_text::cause_text(.0))]
    Sandbox(crate::sandbox::SandboxError),
}

/// Stop every child `provider` left running and forget them: what a provider
/// being removed leaves behind. Each child's process group gets TERM at once,
/// those still running after `grace` (one grace for all) get KILL; a child
/// that survives even that keeps its record, and is said. How many were running.
pub async fn stop_children(
    backend: &dyn ProcessBackend,
    provider: &str,
    grace: Duration,
) -> Result<usize, RecordsError> {
    let mut running = Vec::new();
    for name in backend.children(provider)? {
        // A child gone for good is forgotten by the adoption itself.
        let Ok(Some(record)) = backend.adopt(provider, &name).await else { continue };
        if backend.liveness(&record) == Liveness::Running {
            let _ = backend.signal(&record, Signal::SIGTERM);
            running.push(record);
        } else {
            backend.forget(&record).await;
        }
    }
    let until = std::time::Instant::now() + grace;
    for record in &running {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if backend.wait(record, left).await == Liveness::Running {
            let _ = backend.signal(record, Signal::SIGKILL);
        }
    }
    for record in &running {
        if backend.wait(record, grace).await == Liveness::Running {
            tracing::warn!(provider, child = %record.name, pid = record.pid, "a removed provider's child survived KILL; its record is kept");
            continue;
        }
        backend.forget(record).await;
    }
    Ok(running.len())
}

/// The room: `process = [...]` and what the programs may reach. Linked for
/// every provider (an ungranted call answers `access-denied`). Its backend
/// keeps the host's child records, so only the host (or the kit, a
/// simulation) can give it.
pub struct Process;

impl Room for Process {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "process";
    const MORE_KEYS: &'static [&'static str] = &["paths", "paths-rw", "devices", "env"];
    const LINKING: Linking = Linking::Always;
    const KIT: Option<&'static dyn crate::rooms::kit::KitPart> = Some(&kit::ProgramsKit);
    type Grant = ProcessGrant;
    type Backend = dyn ProcessBackend;
    type Ctx = ProcessCtx;
    /// The programs looked up and confined; `None` when none are granted.
    type Prepared = Option<Arc<ProcessPolicy>>;

    fn host_backend() -> Option<Arc<dyn ProcessBackend>> {
        None
    }

    /// Programs are looked up on the host and confined only where they
    /// really run (a simulation only names them).
    fn prepare(grant: &ProcessGrant, load: &LoadSetup<'_>) -> Result<Option<Arc<ProcessPolicy>>, BoxError> {
        if grant.process.is_empty() {
            return Ok(None);
        }
        // Arguments may name granted paths, read-only or read-write.
        let paths = [grant.paths.clone(), grant.paths_rw.clone()].concat();
        let runs_programs = load.backends.of::<Process>().is_some_and(|backend| backend.runs_programs());
        let policy = if runs_programs {
            ProcessPolicy::resolve(&grant.process, &paths, load.data_dir)
        } else {
            ProcessPolicy::unresolved(&grant.process, &paths, load.data_dir)
        }
        .map_err(ProcessPrepareError::Grant)?
        .with_env(&grant.env)
        .map_err(ProcessPrepareError::Sandbox)?;
        if !runs_programs {
            return Ok(Some(Arc::new(policy)));
        }
        let programs = policy.resolved_programs();
        let confinement = load
            .sandbox
            .confine(
                load.provider,
                &crate::sandbox::Grants {
                    data_dir: load.data_dir,
                    paths: &grant.paths,
                    paths_rw: &grant.paths_rw,
                    devices: &grant.devices,
                    programs: &programs,
                    limits: load.programs,
                },
            )
            .map_err(ProcessPrepareError::Sandbox)?;
        Ok(Some(Arc::new(policy.confined(confinement))))
    }

    fn ctx(grant: &ProcessGrant, backend: Option<Arc<dyn ProcessBackend>>, store: &StoreSetup<'_>) -> ProcessCtx {
        // The policy was prepared from this same grant; checked again all the same.
        let policy = store.prepared.of::<Process>().filter(|_| grant.granted());
        ProcessCtx::new(store.provider, policy, backend, store.denials.clone())
    }

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state: &mut T| {
            let (ctx, table) = state.room::<Process>();
            ProcessView { ctx, table }
        })
    }

    /// The programs and the read-only paths, as the API always listed them.
    fn view(grant: &ProcessGrant) -> Map<String, Value> {
        let paths: Vec<String> = grant.paths.iter().map(|p| p.display().to_string()).collect();
        Map::from_iter([
            ("process".to_owned(), Value::from(grant.process.clone())),
            ("paths".to_owned(), Value::from(paths)),
        ])
    }

    fn shown_view(view: &Map<String, Value>) -> Vec<GrantLine> {
        let list = |key: &str| view.get(key).and_then(|v| Vec::<String>::deserialize(v).ok());
        ["process", "paths"]
            .into_iter()
            .filter_map(|key| list(key).map(|items| GrantLine::new(key, key, shown_list(items))))
            .collect()
    }
}
