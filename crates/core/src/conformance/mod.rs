//! `broker provider test`: run a provider component through the contract's
//! scenarios inside the production sandbox, on simulated capabilities (an
//! in-memory kv, a private machine lock and data dir), without any real
//! infrastructure and without trusting the component.
//!
//! Every capability the manifest grants is simulated from a script
//! (`<manifest>.script.json` beside the manifest, or `--script`; see [`script`]):
//! HTTP exchanges, programs run and their output, spawned children and what
//! they answer on their sockets, the host's network devices. The grants still
//! decide what may be asked; the script answers; nothing real is touched.
//! `--record` runs against the real granted capabilities instead and writes
//! such a script, so a real run becomes a replayable fixture.
//!
//! The scenarios, each a named case: describe is well formed; validate-config
//! accepts its config and rejects garbage as invalid-params; start succeeds,
//! its status updates are progress, its hardware satisfies the constraints, the
//! instance is listed, maintained, stopped and gone; double stop and stop of an
//! unknown id are fine; with zones, a distribution group is spread, a
//! placement in a zone is honoured and an unknown zone is a typed error; every
//! call returns within its deadline; no call touches a capability the manifest
//! does not grant. Each case carries the host calls made during it (`trace`),
//! shown under a failure.

mod junit;
pub mod scenarios;
pub mod script;
mod trace;

use crate::manifest::Manifest;
use crate::manifest::Method;
use crate::runtime::{HostCapabilities, Runtime};
use crate::version::imports::ContractError;
use crate::version::method_stats::Outcome;
use crate::version::{CallError, ProviderVersion, describe_broker_error};
use broker_capabilities::bindings::{BrokerError, Instance};
use broker_capabilities::contract::constraints;
use broker_capabilities::contract::{empty_params, params_with};
use broker_capabilities::rooms::context::CallEvent;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::denials::Denials;
use broker_capabilities::rooms::kit::KitSetup;
use broker_capabilities::rooms::process::LiveChildren;
use broker_capabilities::secrets::{SecretSource, SecretsDir};
pub use script::{Answers, Recording, Scripted};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
pub(crate) use trace::HostCallLog;

/// One scenario's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Case {
    /// What the scenario checks, as a sentence (`double stop is ok`); a
    /// provider's own are `scenario: NAME`.
    pub name: std::borrow::Cow<'static, str>,
    /// Whether the provider did what the contract asks.
    pub passed: bool,
    /// Why it failed, or what was checked.
    pub detail: String,
    /// The host calls the provider made during the case, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trace: Vec<String>,
    /// It could not run (what it needs failed, or a recording must not run
    /// it): neither passed nor failed, and counted as such.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

/// A run of every scenario against one provider component.
#[derive(Debug, Clone)]
pub struct Report {
    pub(crate) provider: String,
    pub(crate) version: String,
    /// One per scenario, in the order run.
    pub cases: Vec<Case>,
    pub(crate) millis: u128,
    /// Hides the provider's secrets in what the run wrote (its recording).
    redactor: Arc<broker_capabilities::secrets::Redactor>,
}

/// `--format json`: the run, its verdict and its totals, then the cases.
impl Serialize for Report {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        #[derive(Serialize)]
        struct Totals {
            cases: usize,
            passed: usize,
            failed: usize,
            skipped: usize,
        }
        let (passed, failed, skipped) = self.totals();
        let mut report = serializer.serialize_struct("Report", 6)?;
        report.serialize_field("provider", &self.provider)?;
        report.serialize_field("version", &self.version)?;
        report.serialize_field("passed", &self.passed())?;
        report.serialize_field("totals", &Totals { cases: self.cases.len(), passed, failed, skipped })?;
        report.serialize_field("cases", &self.cases)?;
        report.serialize_field("millis", &self.millis)?;
        report.end()
    }
}

impl Report {
    /// Hide the provider's secrets in every text of the report (details and
    /// traces: the provider's config, its errors, what it sent, shown back).
    fn redact(&mut self) {
        let redactor = &self.redactor;
        for case in &mut self.cases {
            redactor.redact_string(&mut case.detail);
            case.trace.iter_mut().for_each(|line| redactor.redact_string(line));
        }
    }

    /// `value` as the kit writes it (a recorded script): pretty JSON with the
    /// provider's secrets replaced by their stand-ins (`kit-secret:NAME`).
    pub fn redacted_json(&self, value: &impl Serialize) -> String {
        if self.redactor.is_empty() {
            // As it was made: its fields in their order.
            return serde_json::to_string_pretty(value).unwrap_or_default() + "\n";
        }
        let mut json = serde_json::to_value(value).unwrap_or_default();
        self.redactor.redact_json(&mut json);
        serde_json::to_string_pretty(&json).unwrap_or_default() + "\n"
    }

    /// Whether no case failed (a skipped case is not a failure).
    pub fn passed(&self) -> bool {
        self.cases.iter().all(|c| c.passed || c.skipped)
    }

    /// How many cases passed, failed and were skipped.
    pub fn totals(&self) -> (usize, usize, usize) {
        let skipped = self.cases.iter().filter(|c| c.skipped).count();
        let passed = self.cases.iter().filter(|c| c.passed).count();
        (passed, self.cases.len() - passed - skipped, skipped)
    }

    /// One line per case, each failure followed by its last host calls; what
    /// the provider said is escaped.
    pub fn text(&self) -> String {
        // What the provider said (its version, errors, host calls) is escaped: one line each.
        use broker_capabilities::error_text::escape_unprintable as esc;
        let mut out = format!("provider {} {}\n", esc(&self.provider), esc(&self.version));
        for case in &self.cases {
            let mark = match (case.passed, case.skipped) {
                (true, _) => "ok  ",
                (false, true) => "skip",
                (false, false) => "FAIL",
            };
            out.push_str(&format!("{mark} {:<40} {}\n", case.name, esc(&case.detail)));
            if !case.passed && !case.skipped {
                // What the provider asked of the host on its way to the failure, the last of it.
                let skipped = case.trace.len().saturating_sub(TRACE_SHOWN);
                if skipped > 0 {
                    out.push_str(&format!("       … {skipped} earlier host calls\n"));
                }
                for call in &case.trace[skipped..] {
                    out.push_str(&format!("       {}\n", esc(&call.to_string())));
                }
            }
        }
        let (passed, failed, skipped) = self.totals();
        out.push_str(&format!("{passed} passed, {failed} failed, {skipped} skipped ({} ms)\n", self.millis));
        out
    }
}

/// Why the kit could not run the scenarios (a failed scenario is not an error).
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    /// The component could not be loaded.
    #[error(transparent)]
    Load(#[from] crate::version::LoadError),
    /// The throwaway host the scenarios run in could not be set up.
    #[error("cannot set up the sandbox: {0}")]
    Sandbox(String),
    /// The provider's own scenarios could not be read or parsed.
    #[error("scenarios {path}: {reason}")]
    Scenarios {
        /// The scenarios file.
        path: String,
        /// Why it was refused.
        reason: String,
    },
    /// The script could not be read or parsed.
    #[error("script {path}: {reason}")]
    Script {
        /// The script file.
        path: String,
        /// Why it was refused.
        reason: String,
    },
}

/// How a kit run gets its answers and treats what the script lacks.
pub struct KitOptions {
    /// Where the granted capabilities' answers come from.
    pub answers: Answers,
    /// A host call the script did not answer fails the case it happened in.
    pub strict: bool,
    /// `host.toml`'s `[sandbox]`: how a recording's real programs are confined
    /// (their users come from the range above the one the store allocates from).
    pub sandbox: broker_capabilities::sandbox::SandboxConfig,
    /// Where a recording's signed grants find their credentials
    /// (`DATA_DIR/credentials`); `None`: a signed grant's requests fail.
    pub credentials: Option<std::path::PathBuf>,
    /// Where a recording reads the secrets the manifest names
    /// (`DATA_DIR/secrets`); `None`, or a scripted run: stand-ins
    /// (`kit-secret:NAME`), which a recorded script holds in their place.
    pub secrets: Option<std::path::PathBuf>,
}

impl KitOptions {
    /// The script shipped beside the manifest (`lxd.toml` → `lxd.script.json`),
    /// or an empty one (every host call it would answer is then unscripted).
    pub fn beside(manifest: &Manifest) -> Result<KitOptions, ConformanceError> {
        let path = script_path(&manifest.path);
        let script = match path.exists() {
            true => load_script(&path)?,
            false => Scripted::missing(&path)
                .map_err(|reason| ConformanceError::Script { path: path.display().to_string(), reason })?,
        };
        Ok(KitOptions {
            answers: Answers::Script(Arc::new(script)),
            strict: false,
            sandbox: Default::default(),
            credentials: None,
            secrets: None,
        })
    }
}

/// Where a manifest's own scenarios live: beside it, `<stem>.scenarios.json`.
pub fn scenarios_path(manifest: &std::path::Path) -> std::path::PathBuf {
    manifest.with_extension("scenarios.json")
}

/// The scenarios beside the manifest, read and checked (none if there is no such file).
pub fn scenarios_beside(manifest: &Manifest) -> Result<scenarios::Scenarios, ConformanceError> {
    let path = scenarios_path(&manifest.path);
    if !path.exists() {
        return Ok(scenarios::Scenarios::none());
    }
    let error = |reason: String| ConformanceError::Scenarios { path: path.display().to_string(), reason };
    let bytes =
        crate::manifest::read_regular_file(&path, scenarios::MAX_SCENARIOS_BYTES).map_err(|e| error(e.to_string()))?;
    let text = String::from_utf8(bytes).map_err(|_| error("not UTF-8 text".into()))?;
    scenarios::Scenarios::parse(&text).map_err(error)
}

/// Where a manifest's script lives: beside it, `<stem>.script.json`.
pub fn script_path(manifest: &std::path::Path) -> std::path::PathBuf {
    manifest.with_extension("script.json")
}

/// A kit script file, read and checked.
pub fn load_script(path: &std::path::Path) -> Result<Scripted, ConformanceError> {
    let error = |reason: String| ConformanceError::Script { path: path.display().to_string(), reason };
    // Beside the manifest, which the daemon reads for any API caller: a regular file, bounded.
    let bytes = crate::manifest::read_regular_file(path, 16 << 20).map_err(|e| error(e.to_string()))?;
    let text = String::from_utf8(bytes).map_err(|_| error("not UTF-8 text".into()))?;
    Scripted::parse(&text).map_err(error)
}

/// `swap --check`: a candidate passes when every scenario does, with the
/// script beside its manifest.
pub struct ConformanceCheck;

impl crate::providers::CandidateCheck for ConformanceCheck {
    fn check<'a>(&'a self, manifest: &'a Manifest) -> futures_util::future::BoxFuture<'a, Result<Vec<String>, String>> {
        Box::pin(async move {
            let report = run(manifest).await.map_err(|e| e.to_string())?;
            Ok(report.cases.iter().filter(|c| !c.passed).map(|c| format!("{}: {}", c.name, c.detail)).collect())
        })
    }
}

/// Run every scenario with the script beside the manifest.
pub async fn run(manifest: &Manifest) -> Result<Report, ConformanceError> {
    run_with(manifest, KitOptions::beside(manifest)?).await
}

/// A component loaded into a throwaway host of its own: the kit's simulated
/// (or recorded) capabilities and a scratch data dir.
struct Sandboxed {
    provider: ProviderVersion,
    scripted: Option<Arc<Scripted>>,
    recording: Option<Arc<Recording>>,
    /// Host calls refused for want of a grant.
    denied: Arc<std::sync::Mutex<Vec<String>>>,
    live_children: Arc<LiveChildren>,
    /// Removed when dropped, with the data dirs in it.
    _scratch: tempfile::TempDir,
}

/// A component in the sandbox, or the grant its imports go beyond.
enum Loading {
    Loaded(Box<Sandboxed>),
    /// Importing what the manifest does not grant: a finding about the
    /// component, not a kit failure.
    Ungranted(ContractError),
}

async fn load_sandboxed(manifest: &Manifest, options: &KitOptions) -> Result<Loading, ConformanceError> {
    let scratch = tempfile::Builder::new()
        .prefix("broker-provider-test-")
        .tempdir()
        .map_err(|e| ConformanceError::Sandbox(e.to_string()))?;
    let runtime = Runtime::new(None).map_err(|e| ConformanceError::Sandbox(e.to_string()))?;
    let manifest = manifest.clone();
    let live_children = Arc::new(LiveChildren::default());
    let (denials, denied) = Denials::collecting();
    let data_dirs = scratch.path().join("data");
    let sandbox = broker_capabilities::sandbox::Sandbox::new(options.sandbox.clone(), None);
    let setup = KitSetup {
        grants: manifest.grants.clone(),
        scratch: scratch.path().to_owned(),
        credentials: options.credentials.clone(),
        live_children: live_children.clone(),
    };
    // The sandbox is made of the backends the rooms' kit parts give it (a room
    // given none refuses): scripted, or the host's own recorded.
    let sandbox_error = ConformanceError::Sandbox;
    let (backends, secrets, scripted, recording) = match &options.answers {
        Answers::Script(scripted) => {
            let backends = scripted.backends(&setup).map_err(sandbox_error)?;
            // Stand-ins: a script recorded with the real values holds these in their place.
            (backends, SecretSource::Placeholders, Some(scripted.clone()), None)
        }
        Answers::Record(recording) => {
            let backends = recording.backends(&setup).await.map_err(sandbox_error)?;
            // The operator's, as the daemon reads them; the recording holds stand-ins.
            let secrets = match &options.secrets {
                Some(dir) => SecretSource::Recording(Arc::new(SecretsDir::new(dir.clone()))),
                None => SecretSource::Placeholders,
            };
            (backends, secrets, None, Some(recording.clone()))
        }
    };
    // The kit's data dirs are scratch: a plain directory each.
    let caps = HostCapabilities { data_dirs, sandbox, backends, denials, data_filesystems: None, secrets };
    // Compiling is CPU-bound: off the async workers.
    let loaded = tokio::task::spawn_blocking(move || ProviderVersion::load(runtime, manifest, caps))
        .await
        .map_err(|e| ConformanceError::Sandbox(format!("loading the component: {e}")))?;
    match loaded {
        Ok(provider) => Ok(Loading::Loaded(Box::new(Sandboxed {
            provider,
            scripted,
            recording,
            denied,
            live_children,
            _scratch: scratch,
        }))),
        Err(crate::version::LoadError::Contract { cause: source @ ContractError::NotGranted { .. }, .. }) => {
            Ok(Loading::Ungranted(source))
        }
        Err(e) => Err(e.into()),
    }
}

/// What one call in the sandbox answered, and what the sandbox saw of it.
pub struct SandboxAnswer {
    /// The typed answer as JSON, or why there is none.
    pub answer: Result<serde_json::Value, crate::version::by_name::ByNameError>,
    /// Host calls the script did not answer.
    pub unanswered: Vec<String>,
    /// Host calls refused for want of a grant.
    pub denied: Vec<String>,
}

/// `broker provider call` on a component file: load it into a throwaway
/// sandbox (as the kit does; a fresh one each time, so nothing carries over
/// between calls) and call `method` once.
pub async fn call_in_sandbox(
    manifest: &Manifest,
    options: KitOptions,
    method: Method,
    params: Option<&serde_json::Value>,
    hooks: &CallHooks,
) -> Result<SandboxAnswer, ConformanceError> {
    let sandboxed = match load_sandboxed(manifest, &options).await? {
        Loading::Loaded(sandboxed) => sandboxed,
        Loading::Ungranted(cause) => {
            let provider = manifest.name.clone();
            return Err(crate::version::LoadError::Contract { provider, cause }.into());
        }
    };
    let answer = crate::version::by_name::call_by_name(&sandboxed.provider, method, params, hooks).await;
    sandboxed.live_children.kill_all();
    let unanswered = sandboxed.scripted.as_ref().map(|s| s.take_unexpected()).unwrap_or_default();
    let denied = std::mem::take(&mut *sandboxed.denied.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(SandboxAnswer { answer, unanswered, denied })
}

/// Load the manifest's component into a throwaway sandbox and run every scenario.
pub async fn run_with(manifest: &Manifest, options: KitOptions) -> Result<Report, ConformanceError> {
    let started = Instant::now();
    let sandboxed = match load_sandboxed(manifest, &options).await? {
        Loading::Loaded(sandboxed) => sandboxed,
        Loading::Ungranted(source) => {
            let detail = source.to_string();
            let case = Case { name: UNGRANTED.into(), passed: false, detail, trace: Vec::new(), skipped: false };
            return Ok(Report {
                provider: manifest.name.clone(),
                version: String::new(),
                cases: vec![case],
                millis: 0,
                redactor: Arc::default(),
            });
        }
    };
    let provided = scenarios_beside(manifest)?;
    let Sandboxed { provider, scripted, recording, denied, live_children, _scratch } = *sandboxed;
    let config = provider.guest_config();
    let redactor = provider.redactor().clone();
    let calls = HostCallLog::redacting(redactor.clone());
    let dispatch = calls.dispatch();
    let guard = recording.map(|recording| RecordGuard {
        run: format!("run-{}", std::time::SystemTime::UNIX_EPOCH.elapsed().map(|d| d.as_millis()).unwrap_or(0)),
        existed: Default::default(),
        started: Default::default(),
        blind: false,
        recording,
    });
    let mut kit = Kit { provider, cases: Vec::new(), scripted, strict: options.strict, denied, calls, guard };
    let scenarios = async {
        if kit.guard.is_some() {
            kit.note_existing().await;
        }
        let (name, version, features) = kit.describe().await;
        kit.validate_config(&config).await;
        kit.lifecycle().await;
        if features.iter().any(|f| f == "zones") {
            let zones = kit.distribution_group().await;
            kit.placement(zones).await;
            kit.unknown_zone().await;
        }
        kit.provided(&provided).await;
        kit.deadlines();
        kit.grants();
        (name, version)
    };
    // Under the kit's own dispatcher: the host calls made while it is polled are the provider's.
    let (name, version) = tracing::instrument::WithSubscriber::with_subscriber(scenarios, dispatch).await;
    // A recorded run spawns real programs: none may outlive it, whatever the provider left.
    live_children.kill_all();
    let mut report =
        Report { provider: name, version, cases: kit.cases, millis: started.elapsed().as_millis(), redactor };
    report.redact();
    Ok(report)
}

/// The lifecycle's cases after its start, skipped when the start fails.
const LIFECYCLE_AFTER_START: [&str; 7] = [
    "status updates of a start are progress",
    "hardware satisfies the constraints",
    "started instance is listed",
    "maintain-instance on a known instance",
    "stop-instances succeeds",
    "stopped instance is gone",
    "double stop is ok",
];

/// How many host calls the text report shows under a failed case.
const TRACE_SHOWN: usize = 12;

/// The case every host-call denial fails.
const UNGRANTED: &str = "no call touches an ungranted capability";

struct Kit {
    provider: ProviderVersion,
    cases: Vec<Case>,
    /// The script, whose unanswered host calls each case reports.
    scripted: Option<Arc<Scripted>>,
    strict: bool,
    /// Host calls refused so far for want of a grant (whether or not the provider passed the refusal on).
    denied: Arc<std::sync::Mutex<Vec<String>>>,
    /// Every host call so far; each case takes those made since the one before.
    calls: HostCallLog,
    /// In a recording against real endpoints: what it may stop.
    guard: Option<RecordGuard>,
}

/// The id the kit stops to see an unknown id ignored.
const UNKNOWN_ID: &str = "broker-provider-test-never-existed";

/// The instance tag every start of a recording carries (its value: the run).
pub const RECORDING_TAG: &str = "broker-provider-test";

/// A recording runs against real endpoints: it stops only what its own
/// starts made, and never an instance that was there before it.
struct RecordGuard {
    /// Its tape is paused while the kit looks at what existed (not a scenario's exchange).
    recording: Arc<Recording>,
    run: String,
    existed: std::collections::HashSet<String>,
    started: std::collections::HashSet<String>,
    /// What existed could not be listed: nothing is stopped.
    blind: bool,
}

/// A call's error as a case reports it.
fn explain(err: &CallError) -> String {
    match err {
        CallError::Guest { error, .. } => describe_broker_error(error),
        other => other.to_string(),
    }
}

fn zone_of(started: &broker_capabilities::bindings::StartInstanceResult) -> Option<String> {
    started.hardware.as_ref().and_then(|h| h.availability_zone.clone())
}

fn ids(instances: &[Instance]) -> Vec<String> {
    instances.iter().map(|i| i.id.clone()).collect()
}

impl Kit {
    fn record(&mut self, name: impl Into<std::borrow::Cow<'static, str>>, result: Result<String, String>) {
        let (mut passed, mut detail) = match result {
            Ok(detail) => (true, detail),
            Err(detail) => (false, detail),
        };
        let unexpected = self.scripted.as_ref().map(|s| s.take_unexpected()).unwrap_or_default();
        if !unexpected.is_empty() {
            passed &= !self.strict;
            // A failure that already quotes the unscripted call need not say it twice.
            let unsaid: Vec<&str> =
                unexpected.iter().map(String::as_str).filter(|call| !detail.contains(call)).collect();
            if !unsaid.is_empty() {
                detail.push_str(&format!("; host calls not in the script: {}", unsaid.join("; ")));
            }
        }
        let trace = self.calls.take();
        self.cases.push(Case { name: name.into(), passed, detail, trace, skipped: false });
    }

    /// A case that could not run, and why.
    fn skip(&mut self, name: impl Into<std::borrow::Cow<'static, str>>, why: &str) {
        let trace = self.calls.take();
        let name = name.into();
        self.cases.push(Case { name, passed: false, detail: format!("not run: {why}"), trace, skipped: true });
    }

    /// A start of the kit's own: in a recording, tagged with the run's tag,
    /// and its id kept as one this run may stop.
    async fn start(
        &mut self,
        hooks: &CallHooks,
        params: &broker_capabilities::bindings::StartInstanceParams,
    ) -> Result<broker_capabilities::bindings::StartInstanceResult, CallError> {
        let Some(guard) = &mut self.guard else { return self.provider.start_instance(hooks, params).await };
        let mut params = params.clone();
        let config = params.instance_config.get_or_insert_with(broker_capabilities::contract::empty_instance_config);
        config.tags.push((RECORDING_TAG.to_owned(), guard.run.clone()));
        let started = self.provider.start_instance(hooks, &params).await?;
        let id = &started.instance.id;
        if guard.existed.contains(id) {
            tracing::warn!(instance_id = %id, "a start in the recording answered with the id of an instance that existed before it: it will not be stopped");
        } else {
            guard.started.insert(id.clone());
        }
        Ok(started)
    }

    /// Stop instances; in a recording, only those its own starts made.
    async fn stop(&self, ids: &[String]) -> Result<(), String> {
        if let Some(guard) = &self.guard {
            if guard.blind {
                return Err(format!(
                    "a recording that could not list what existed before it stops nothing; refused to stop {ids:?}"
                ));
            }
            let foreign: Vec<&String> = ids.iter().filter(|id| !guard.started.contains(*id)).collect();
            if !foreign.is_empty() {
                return Err(format!(
                    "a recording stops only instances its own starts made; refused to stop {foreign:?}{}",
                    if foreign.iter().any(|id| guard.existed.contains(*id)) {
                        " (an instance that existed before this run)"
                    } else {
                        ""
                    }
                ));
            }
        }
        self.provider.stop_instances(&CallHooks::default(), ids).await.map_err(|e| explain(&e))
    }

    async fn describe(&mut self) -> (String, String, Vec<String>) {
        match self.provider.describe().await {
            Ok(info) => {
                let ok = !info.name.is_empty() && !info.version.is_empty();
                let detail = format!("{} {} features {:?}", info.name, info.version, info.features);
                self.record(
                    "describe is well formed",
                    if ok { Ok(detail) } else { Err(format!("empty field: {detail}")) },
                );
                (info.name, info.version, info.features)
            }
            Err(e) => {
                self.record("describe is well formed", Err(explain(&e)));
                (self.provider.name().to_owned(), String::new(), Vec::new())
            }
        }
    }

    async fn validate_config(&mut self, config: &str) {
        let accepted = self.provider.validate_config(config).await;
        self.record(
            "validate-config accepts its config",
            accepted.map(|_| format!("accepted {config}")).map_err(|e| explain(&e)),
        );
        let garbage_cases = [
            ("validate-config rejects garbage: not JSON", "not json at all"),
            ("validate-config rejects garbage: an unknown setting", r#"{"definitely-not-a-setting": [1, 2, 3]}"#),
        ];
        for (case, garbage) in garbage_cases {
            let result = match self.provider.validate_config(garbage).await {
                Err(CallError::Guest { error: BrokerError::InvalidParams(_), .. }) => Ok(format!("rejected {garbage}")),
                Err(e) => Err(format!("rejected {garbage} but not as invalid-params: {}", explain(&e))),
                Ok(()) => Err(format!("accepted garbage config {garbage}")),
            };
            self.record(case, result);
        }
    }

    async fn all(&self) -> Result<Vec<Instance>, String> {
        self.provider.all_instances(&CallHooks::default()).await.map_err(|e| explain(&e))
    }

    async fn lifecycle(&mut self) {
        let asked = "arch=amd64 cores=2 mem=1024";
        let params = params_with(constraints::parse(asked).unwrap_or_else(|_| constraints::empty()));
        let events: Arc<std::sync::Mutex<Vec<CallEvent>>> = Arc::default();
        let seen = events.clone();
        let hooks = CallHooks::with_events(move |event| seen.lock().unwrap_or_else(|p| p.into_inner()).push(event));
        let started = match self.start(&hooks, &params).await {
            Ok(result) => result,
            Err(e) => {
                self.record("start-instance succeeds", Err(explain(&e)));
                return self.after_a_failed_start().await;
            }
        };
        let id = started.instance.id.clone();
        // The host refuses such an id from a provider: a kit pass must mean the host takes it.
        if let Some(problem) = crate::store::records::instance_id_problem(&id) {
            let shown = crate::store::records::id_for_message(&id);
            // As the host does with such an id: stop what was started, so nothing real is left running.
            let stopped = self.stop(std::slice::from_ref(&id)).await;
            let left = stopped.err().map(|e| format!("; stopping it failed too: {e}")).unwrap_or_default();
            self.record("start-instance succeeds", Err(format!("the host refuses the id {shown}: {problem}{left}")));
            return self.after_a_failed_start().await;
        }
        self.record("start-instance succeeds", Ok(format!("started {id}")));
        let events = std::mem::take(&mut *events.lock().unwrap_or_else(|p| p.into_inner()));
        self.record("status updates of a start are progress", progress_only(&events));

        let hardware = started.hardware.clone();
        let consistent = match &hardware {
            None => Ok("no hardware reported (allowed)".to_owned()),
            Some(h) => {
                let mut problems = Vec::new();
                if h.arch.as_deref().is_some_and(|a| a != "amd64") {
                    problems.push(format!("arch {:?} for arch=amd64", h.arch));
                }
                if h.cpu_cores.is_some_and(|c| c < 2) {
                    problems.push(format!("cpu-cores {:?} for cores=2", h.cpu_cores));
                }
                if h.mem.is_some_and(|m| m < 1024) {
                    problems.push(format!("mem {:?} MiB for mem=1024", h.mem));
                }
                if problems.is_empty() { Ok(format!("hardware satisfies {asked}")) } else { Err(problems.join("; ")) }
            }
        };
        self.record("hardware satisfies the constraints", consistent);

        let listed = self.all().await.and_then(|all| {
            if ids(&all).contains(&id) {
                Ok(format!("{id} listed"))
            } else {
                Err(format!("{id} missing from {:?}", ids(&all)))
            }
        });
        self.record("started instance is listed", listed);

        let maintained = self.provider.maintain_instance(&CallHooks::default(), &id, &params).await;
        self.record(
            "maintain-instance on a known instance",
            maintained.map(|_| format!("maintained {id}")).map_err(|e| explain(&e)),
        );

        let stopped = self.stop(std::slice::from_ref(&id)).await;
        self.record("stop-instances succeeds", stopped.map(|_| format!("stopped {id}")));
        let gone = self.all().await.and_then(|all| {
            if ids(&all).contains(&id) {
                Err(format!("{id} still listed after stop"))
            } else {
                Ok(format!("{id} gone"))
            }
        });
        self.record("stopped instance is gone", gone);

        let again = self.stop(std::slice::from_ref(&id)).await;
        self.record(
            "double stop is ok",
            again.map(|_| "stopped twice".to_owned()).map_err(|e| format!("second stop of {id} returned {e}")),
        );
        self.stop_unknown().await;
    }

    /// The lifecycle after its start failed: the cases that needed the
    /// instance are skipped, the one that did not still runs.
    async fn after_a_failed_start(&mut self) {
        for case in LIFECYCLE_AFTER_START {
            self.skip(case, "start-instance failed");
        }
        self.stop_unknown().await;
    }

    /// Stopping an id nobody has is fine. (The one stop a recording makes
    /// of an id its starts did not return: the kit's own, which names nothing.)
    async fn stop_unknown(&mut self) {
        const CASE: &str = "stop of an unknown id is ok";
        let unknown = UNKNOWN_ID.to_owned();
        let result = self.provider.stop_instances(&CallHooks::default(), std::slice::from_ref(&unknown)).await;
        self.record(
            CASE,
            result
                .map(|_| "ignored".to_owned())
                .map_err(|e| format!("stop-instances of an unknown id returned {}", explain(&e))),
        );
    }

    /// The instances the provider lists before a recording starts anything.
    async fn note_existing(&mut self) {
        let recording = self.guard.as_ref().map(|guard| guard.recording.clone());
        recording.iter().for_each(|recording| recording.pause(true));
        let listed = self.provider.all_instances(&CallHooks::default()).await;
        recording.iter().for_each(|recording| recording.pause(false));
        match listed {
            Ok(all) => {
                if let Some(guard) = &mut self.guard {
                    guard.existed = all.into_iter().map(|i| i.id).collect();
                }
            }
            Err(e) => {
                // Blind to what was there, it stops nothing at all.
                tracing::warn!(error = %explain(&e), "a recording could not list what existed before it: it will stop nothing");
                if let Some(guard) = &mut self.guard {
                    guard.blind = true;
                }
            }
        }
        // Not a case: what it asked of the host belongs to none.
        let _ = self.calls.take();
    }

    /// A provider that claims zones spreads a distribution group over them.
    /// Returns the zones the two members went to, as far as they said.
    async fn distribution_group(&mut self) -> Vec<String> {
        const CASE: &str = "distribution group is spread over zones";
        let first = match self.start(&CallHooks::default(), &empty_params()).await {
            Ok(r) => r,
            Err(e) => {
                self.record(CASE, Err(explain(&e)));
                return Vec::new();
            }
        };
        let group = vec![first.instance.id.clone()];
        let hooks = CallHooks { distribution_group: Some(Arc::new(move || Ok(group.clone()))), ..Default::default() };
        let second = self.start(&hooks, &empty_params()).await;
        let mut started = vec![first.instance.id.clone()];
        let zones: Vec<String> = match &second {
            Ok(second) => {
                started.push(second.instance.id.clone());
                [zone_of(&first), zone_of(second)].into_iter().flatten().collect()
            }
            Err(_) => zone_of(&first).into_iter().collect(),
        };
        let result = match second {
            Err(e) => Err(explain(&e)),
            Ok(second) => match (zone_of(&first), zone_of(&second)) {
                (Some(a), Some(b)) if a != b => Ok(format!("{a} then {b}")),
                (a, b) => Err(format!("second group member went to {b:?}, the first was in {a:?}")),
            },
        };
        self.stop_quietly(&started).await;
        self.record(CASE, result);
        zones
    }

    /// A placement in a zone the provider has puts the instance there: the
    /// zone the last group member went to, which an unplaced start would not
    /// pick next (it prefers the emptier or the earlier zones).
    async fn placement(&mut self, zones: Vec<String>) {
        const CASE: &str = "a placement in a zone is honoured";
        let Some(zone) = zones.last() else {
            return self.record(CASE, Err("no zone to place in: no start reported an availability zone".into()));
        };
        let mut params = empty_params();
        params.placement = Some(format!("zone={zone}"));
        let result = match self.start(&CallHooks::default(), &params).await {
            Err(e) => Err(format!("placement zone={zone} refused: {}", explain(&e))),
            Ok(placed) => {
                self.stop_quietly(std::slice::from_ref(&placed.instance.id)).await;
                match zone_of(&placed) {
                    Some(landed) if landed == *zone => Ok(format!("placed in {zone}")),
                    landed => Err(format!("placement zone={zone} landed in {landed:?}")),
                }
            }
        };
        self.record(CASE, result);
    }

    /// Stop what a scenario started for itself; its own outcome is not the case's.
    async fn stop_quietly(&self, ids: &[String]) {
        if let Err(e) = self.stop(ids).await {
            tracing::debug!(error = %e, "stopping what a scenario started");
        }
    }

    /// A placement in a zone the provider does not have is refused with a typed error.
    async fn unknown_zone(&mut self) {
        const CASE: &str = "an unknown zone is a typed error";
        let mut params = empty_params();
        params.placement = Some("zone=broker-provider-test-no-such-zone".into());
        let result = match self.start(&CallHooks::default(), &params).await {
            Err(CallError::Guest { error: BrokerError::Provider(message), .. }) => Err(format!(
                "an unknown zone came back as a provider string ({message:?}), not a typed error \
                 (invalid-params, not-found, zone-unavailable, …)"
            )),
            Err(e @ CallError::Guest { .. }) => Ok(explain(&e)),
            Err(e) => Err(explain(&e)),
            Ok(started) => {
                let id = started.instance.id;
                let _ = self.stop(std::slice::from_ref(&id)).await;
                Err(format!("started {id} in an unknown zone"))
            }
        };
        self.record(CASE, result);
    }

    /// Every call of the run returned before its deadline (the host kills one that does not).
    /// The provider's own scenarios, a case each: its steps in order, the
    /// first that does not answer as expected failing the case.
    async fn provided(&mut self, provided: &scenarios::Scenarios) {
        for scenario in provided.iter() {
            let name = format!("scenario: {}", scenario.name);
            if self.guard.is_some() {
                // Its starts would be real and untagged: a recording stops only its own.
                self.skip(name, "a recording runs the built-in cases only");
                continue;
            }
            let outcome = self.run_steps(scenario).await;
            self.record(name, outcome);
        }
    }

    async fn run_steps(&mut self, scenario: &scenarios::Scenario) -> Result<String, String> {
        let mut saved = scenarios::Saved::default();
        for (i, step) in scenario.steps.iter().enumerate() {
            let at = |why: String| format!("step {} ({}): {why}", i + 1, step.call_name());
            let params = step.params(&saved).map_err(at)?;
            let answered = crate::version::by_name::call_by_name(
                &self.provider,
                step.method(),
                params.as_ref(),
                &CallHooks::default(),
            )
            .await;
            let outcome = answered.map_err(|failed| match &failed {
                crate::version::by_name::ByNameError::Call(call) => {
                    (call.report().kind.name().to_owned(), explain(call))
                }
                refused => ("bad-request".to_owned(), refused.to_string()),
            });
            step.check(&outcome, &saved).map_err(at)?;
            if let (Some(name), Ok(answer)) = (step.save_as(), outcome) {
                saved.keep(name, answer);
            }
        }
        Ok(format!("{} steps as expected", scenario.steps.len()))
    }

    fn deadlines(&mut self) {
        let deadlines = &self.provider.manifest().limits.deadlines;
        let mut calls = 0;
        let mut overruns = Vec::new();
        for method in Method::ALL {
            let stats = self.provider.stats().methods.get(method);
            calls += stats.count();
            let n = stats.outcome(Outcome::Deadline);
            if n > 0 {
                let budget = humantime::format_duration(deadlines.for_method(method));
                overruns.push(format!("{} exceeded its deadline {budget} ({n} call(s))", method.name()));
            }
        }
        let result = if overruns.is_empty() {
            Ok(format!("{calls} calls, none over its deadline"))
        } else {
            Err(overruns.join("; "))
        };
        self.record("every call returns within its deadline", result);
    }

    /// No host call of the run was refused for want of a grant.
    fn grants(&mut self) {
        let denied = std::mem::take(&mut *self.denied.lock().unwrap_or_else(|p| p.into_inner()));
        // The same refusal repeated is one finding with a count.
        let mut findings: Vec<(String, usize)> = Vec::new();
        for refusal in denied {
            match findings.iter_mut().find(|(seen, _)| *seen == refusal) {
                Some((_, count)) => *count += 1,
                None => findings.push((refusal, 1)),
            }
        }
        let said: Vec<String> = findings
            .into_iter()
            .map(|(refusal, count)| {
                let (interface, why) = refusal.split_once(": ").unwrap_or(("a capability", &refusal));
                format!("called {interface} without a grant, {count} time(s): {why}")
            })
            .collect();
        let result = if said.is_empty() { Ok("no capability refused".to_owned()) } else { Err(said.join("; ")) };
        self.record(UNGRANTED, result);
    }
}

/// A successful start reports only progress: pending, allocating, provisioning, running.
fn progress_only(events: &[CallEvent]) -> Result<String, String> {
    use broker_capabilities::bindings::InstanceStatus as S;
    let mut seen = Vec::new();
    for event in events {
        if let CallEvent::Status { status, info, .. } = event {
            let name = crate::store::records::status_name(*status);
            if !matches!(status, S::Pending | S::Allocating | S::Provisioning | S::Running) {
                return Err(format!("a start that succeeded reported {name} ({info:?}) on the way"));
            }
            seen.push(name);
        }
    }
    Ok(if seen.is_empty() { "no status updates".to_owned() } else { seen.join(" → ") })
}
