//! `broker:provider/process`: granted programs only, no shell, capped output,
//! process-group kills, and long-running children that survive the host.
//! In the conformance kit the same checks lead to a simulated process table
//! ([`simulated`]) or to the real one with every call written down ([`tape`]).

mod children;
mod policy;
pub mod simulated;
pub mod tape;

pub use children::{ChildRecord, ChildRecords, LiveChildren, Liveness, MemoryChildRecords, RecordsError, proc_stat};
pub use policy::{GUEST_DATA_DIR, PolicyError, ProcessPolicy};
pub use simulated::SimProcesses;
pub use tape::ProcessTape;

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::process::{self as wit, ChildStatus, Output};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

/// Each of stdout and stderr of `run` is cut at this size.
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// How often `wait` looks at a child that is not ours to wait on.
const WAIT_POLL: Duration = Duration::from_millis(10);

/// What a provider's granted process calls reach.
#[derive(Clone, Default)]
pub enum ProcessWorld {
    /// Real programs and children.
    #[default]
    Host,
    /// Real programs and children, every call written to the tape.
    Record(Arc<ProcessTape>),
    /// Scripted programs and simulated children; nothing is run.
    Simulated(Arc<SimProcesses>),
}

/// The host object behind a guest's `child` handle.
pub struct HeldChild {
    record: ChildRecord,
}

pub struct ProcessCtx {
    provider: String,
    /// `None` when the manifest grants no programs.
    policy: Option<Arc<ProcessPolicy>>,
    records: Arc<dyn ChildRecords>,
    live: Arc<LiveChildren>,
    world: ProcessWorld,
    /// Where refusals are noted (set by the store that owns this).
    pub denials: crate::capabilities::denials::Denials,
}

impl ProcessCtx {
    pub fn new(
        provider: &str,
        policy: Option<Arc<ProcessPolicy>>,
        records: Arc<dyn ChildRecords>,
        live: Arc<LiveChildren>,
        world: ProcessWorld,
    ) -> Self {
        ProcessCtx { provider: provider.to_owned(), policy, records, live, world, denials: Default::default() }
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

/// The confined command for a granted program: a program never runs on the host unconfined.
fn confined_command(
    policy: &ProcessPolicy,
    path: &std::path::Path,
    args: &[String],
    env: &[(String, String)],
    lifetime: crate::sandbox::Lifetime,
) -> Result<std::process::Command, BrokerError> {
    let confinement = policy.confinement().ok_or_else(|| denied(PolicyError::Unconfined))?;
    Ok(confinement.command(path, args, env, lifetime))
}

/// Kills a process group when dropped, unless disarmed: a timed-out or
/// abandoned `run` takes its grandchildren with it.
struct GroupKiller(Option<i32>);

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
    }
}

/// Read all of `stream`, keeping at most `cap` bytes.
async fn read_capped(mut stream: impl AsyncRead + Unpin, cap: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return (kept, truncated),
            Ok(n) => {
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
                truncated |= n > room;
            }
        }
    }
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

impl ProcessCtx {
    async fn run(
        &self,
        program: &str,
        guest_args: &[String],
        env: &[(String, String)],
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> Result<Output, BrokerError> {
        let policy = self.policy()?;
        let path = policy.program(program).map_err(denied)?;
        let args = translate_all(policy, guest_args)?;
        let env = translate_env(policy, env)?;
        if let ProcessWorld::Simulated(sim) = &self.world {
            return sim.run(program, guest_args);
        }
        let output = self.run_on_host(policy, &path, args, env, stdin, timeout_ms).await;
        if let (ProcessWorld::Record(tape), Ok(output)) = (&self.world, &output) {
            tape.ran(program, guest_args, output);
        }
        output
    }

    async fn run_on_host(
        &self,
        policy: &ProcessPolicy,
        path: &std::path::Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> Result<Output, BrokerError> {
        // A session and process group of its own (set up before exec): the group killer reaches it all.
        let mut command =
            tokio::process::Command::from(confined_command(policy, path, &args, &env, crate::sandbox::Lifetime::Call)?);
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let mut child =
            command.spawn().map_err(|e| BrokerError::Provider(format!("cannot run {}: {e}", path.display())))?;
        let mut group = GroupKiller(child.id().map(|pid| pid as i32));
        tracing::debug!(provider = %self.provider, program = %path.display(), pid = ?child.id(), "run");

        let mut input = child.stdin.take();
        let feed = async move {
            if let Some(input) = input.as_mut() {
                let _ = input.write_all(&stdin).await;
            }
            drop(input);
        };
        let stdout = read_capped(child.stdout.take().expect("piped"), MAX_OUTPUT_BYTES);
        let stderr = read_capped(child.stderr.take().expect("piped"), MAX_OUTPUT_BYTES);
        let finish = async { tokio::join!(feed, stdout, stderr, child.wait()) };
        let outcome = if timeout_ms == 0 {
            Ok(finish.await)
        } else {
            tokio::time::timeout(Duration::from_millis(timeout_ms), finish).await
        };
        match outcome {
            Ok((_, (stdout, out_cut), (stderr, err_cut), status)) => {
                group.0 = None;
                let status =
                    status.map_err(|e| BrokerError::Provider(format!("waiting for {}: {e}", path.display())))?;
                use std::os::unix::process::ExitStatusExt;
                Ok(Output {
                    exit_code: status.code(),
                    signal: status.signal(),
                    stdout,
                    stderr,
                    truncated: out_cut || err_cut,
                    timed_out: false,
                })
            }
            Err(_elapsed) => {
                drop(group); // SIGKILL to the whole group
                Ok(Output {
                    exit_code: None,
                    signal: Some(Signal::SIGKILL as i32),
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                    truncated: false,
                    timed_out: true,
                })
            }
        }
    }

    fn spawn(
        &self,
        name: &str,
        program: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> Result<ChildRecord, BrokerError> {
        let policy = self.policy()?;
        self.live.reap();
        if !valid_child_name(name) {
            return Err(BrokerError::InvalidParams(format!(
                "child name {name:?} must be 1-64 letters, digits, '-', '_' or '.'"
            )));
        }
        let path = policy.program(program).map_err(denied)?;
        let guest_args = args;
        let args = translate_all(policy, guest_args)?;
        let env = translate_env(policy, env)?;
        if let ProcessWorld::Simulated(sim) = &self.world {
            return sim.spawn(&self.provider, name, program, guest_args);
        }
        if let Some(existing) = self.records.get(&self.provider, name).map_err(|e| BrokerError::Provider(e.0))?
            && self.live.liveness(&existing) == Liveness::Running
        {
            return Err(BrokerError::InvalidParams(format!("a child named {name:?} is still running")));
        }
        // The provider may have planted links in its data dir: the log is opened beneath it, following none.
        let logs = policy.data_dir().join("logs");
        let log_path = logs.join(format!("{name}.log"));
        let log = crate::sandbox::beneath::dir(policy.data_dir(), std::path::Path::new("logs"))
            .and_then(|dir| crate::sandbox::beneath::append(&dir, &logs, &format!("{name}.log")))
            .map_err(|e| match e {
                // A link where the log goes is the provider's doing: refused, and noted as such.
                crate::sandbox::beneath::BeneathError::Escapes { .. } => {
                    BrokerError::AccessDenied(format!("cannot open the child's log: {e}"))
                }
                crate::sandbox::beneath::BeneathError::Io { .. } => {
                    BrokerError::Provider(format!("cannot open the child's log: {e}"))
                }
            })?;
        let log_err = log.try_clone().map_err(|e| BrokerError::Provider(e.to_string()))?;
        // A session and process group of its own: signals go to the whole group,
        // and the host's own signals (Ctrl-C) and terminal do not reach it.
        let child = confined_command(policy, &path, &args, &env, crate::sandbox::Lifetime::Detached)?
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|e| BrokerError::Provider(format!("cannot spawn {}: {e}", path.display())))?;
        let pid = child.id();
        let start_time = proc_stat(pid).map(|(start, _)| start).unwrap_or(0);
        let record = ChildRecord {
            provider: self.provider.clone(),
            name: name.to_owned(),
            pid,
            start_time,
            program: path.display().to_string(),
            args,
            log: log_path.display().to_string(),
        };
        self.live.insert(&self.provider, name, child);
        self.records.put(&record).map_err(|e| BrokerError::Provider(e.0))?;
        tracing::info!(provider = %self.provider, child = name, pid, "spawned child");
        if let ProcessWorld::Record(tape) = &self.world {
            tape.spawned(&record, program, guest_args);
        }
        Ok(record)
    }

    fn adopt(&self, name: &str) -> Result<Option<ChildRecord>, BrokerError> {
        self.policy()?;
        if let ProcessWorld::Simulated(sim) = &self.world {
            return Ok(sim.adopt(&self.provider, name));
        }
        let Some(record) = self.records.get(&self.provider, name).map_err(|e| BrokerError::Provider(e.0))? else {
            return Ok(None);
        };
        if self.liveness(&record) == Liveness::Gone {
            // Gone for good (or its pid was recycled): forget it.
            self.records.remove(&self.provider, name).map_err(|e| BrokerError::Provider(e.0))?;
            self.live.remove(&self.provider, name);
            return Ok(None);
        }
        Ok(Some(record))
    }

    /// How the child is doing, in this ctx's world.
    fn liveness(&self, record: &ChildRecord) -> Liveness {
        let liveness = match &self.world {
            ProcessWorld::Simulated(sim) => return sim.liveness(record),
            ProcessWorld::Host | ProcessWorld::Record(_) => self.live.liveness(record),
        };
        if let ProcessWorld::Record(tape) = &self.world {
            tape.observed(record, liveness);
        }
        liveness
    }

    fn signal(&self, record: &ChildRecord, signal: Signal) -> Result<(), BrokerError> {
        // Only the very process we started: pid and start time must both match.
        if self.liveness(record) != Liveness::Running {
            return Err(BrokerError::NotFound(format!("child {:?} is not running", record.name)));
        }
        match &self.world {
            ProcessWorld::Simulated(sim) => return sim.signal(record, signal as i32),
            ProcessWorld::Record(tape) => tape.signalled(record),
            ProcessWorld::Host => {}
        }
        killpg(Pid::from_raw(record.pid as i32), signal)
            .map_err(|e| BrokerError::Provider(format!("signal {signal} to child {:?}: {e}", record.name)))
    }

    fn forget(&self, record: &ChildRecord) {
        if let ProcessWorld::Simulated(sim) = &self.world {
            return sim.forget(record);
        }
        let _ = self.records.remove(&record.provider, &record.name);
        self.live.remove(&record.provider, &record.name);
    }

    fn children(&self) -> Result<Vec<String>, RecordsError> {
        if let ProcessWorld::Simulated(sim) = &self.world {
            return Ok(sim.children(&self.provider));
        }
        self.live.reap();
        Ok(self.records.list(&self.provider)?.into_iter().map(|r| r.name).collect())
    }
}

pub struct ProcessView<'a> {
    pub ctx: &'a mut ProcessCtx,
    pub table: &'a mut ResourceTable,
}

pub struct ProcessData;

impl HasData for ProcessData {
    type Data<'a> = ProcessView<'a>;
}

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
        match self.ctx.spawn(&name, &program, &args, &env) {
            Ok(record) => Ok(Ok(self.hold(record)?)),
            Err(e) => Ok(Err(self.ctx.denials.refuse("process", e))),
        }
    }

    async fn adopt(&mut self, name: String) -> wasmtime::Result<Result<Option<Resource<HeldChild>>, BrokerError>> {
        match self.ctx.adopt(&name) {
            Ok(Some(record)) => Ok(Ok(Some(self.hold(record)?))),
            Ok(None) => Ok(Ok(None)),
            Err(e) => Ok(Err(self.ctx.denials.refuse("process", e))),
        }
    }

    async fn children(&mut self) -> wasmtime::Result<Vec<String>> {
        if self.ctx.policy.is_none() {
            return Ok(Vec::new());
        }
        match self.ctx.children() {
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
        Ok(status_of(self.ctx.liveness(&record)))
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
        let until = Instant::now() + Duration::from_millis(timeout_ms);
        // A simulated child changes only when the provider acts: waiting on it cannot help.
        let simulated = matches!(self.ctx.world, ProcessWorld::Simulated(_));
        loop {
            let liveness = self.ctx.liveness(&record);
            if liveness != Liveness::Running || Instant::now() >= until || simulated {
                return Ok(status_of(liveness));
            }
            tokio::time::sleep(WAIT_POLL).await;
        }
    }

    async fn forget(&mut self, handle: Resource<HeldChild>) -> wasmtime::Result<()> {
        let record = self.record(&handle)?;
        self.ctx.forget(&record);
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
    wit::add_to_linker::<T, ProcessData>(linker, getter)
}
