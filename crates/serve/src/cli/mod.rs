//! The `broker` command line. Exit codes: 0 success, 1 the operation failed,
//! 2 usage error.

mod backend;
mod groups;
mod lock;
mod output;
mod scaffold;

use anyhow::{Context, Result};
use backend::Backend;
use broker_capabilities::contract::constraints;
use broker_capabilities::rooms::context::{CallEvent, CallHooks};
use broker_core::error_report::{ErrorKind, ErrorReport};
use broker_core::store::records::status_name;
use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The parsed command line (its help comes from `about`/`long_about`, not this comment).
#[derive(Debug, Parser)]
#[command(
    name = "broker",
    version,
    about = "A per-machine broker host: runs sandboxed provider components behind Juju's InstanceBroker contract",
    long_about = "A per-machine broker host. Provider logic (LXD, KVM, a cloud, the fake) runs as sandboxed \
                  WebAssembly components that get nothing but what their manifest grants; the host keeps \
                  the state, in --data-dir.\n\nExit codes: 0 success, 1 the operation failed, 2 usage error."
)]
pub(crate) struct Cli {
    /// Where the host keeps its state and compiled-component cache.
    #[arg(long, global = true, env = "BROKER_DATA_DIR", default_value_os_t = default_data_dir())]
    pub(crate) data_dir: PathBuf,
    /// The daemon's socket (default DATA_DIR/broker.sock). `serve` listens on it; every
    /// other command talks to the daemon there when one answers, and opens the state
    /// in DATA_DIR itself when none does. The output is the same either way.
    #[arg(long, global = true, env = "BROKER_SOCKET", value_name = "PATH")]
    pub(crate) socket: Option<PathBuf>,
    /// More logging on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
    /// Most MiB a component's compile may take (it runs in a child of this binary;
    /// past this the component is refused). Compiled components are kept, so a
    /// component is compiled once. With a daemon answering, the daemon compiles, with
    /// its own limits: give them to `broker serve`.
    #[arg(long, global = true, env = "BROKER_COMPILE_MEMORY_MIB", value_name = "MIB",
          default_value_t = broker_core::runtime::compiled::CompileLimits::default().memory_bytes >> 20,
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub(crate) compile_memory_mib: u64,
    /// Longest a component's compile may take before it is stopped and the component
    /// refused (1s to 1h). With a daemon answering, the daemon's applies.
    #[arg(long, global = true, env = "BROKER_COMPILE_TIMEOUT", value_name = "DURATION", default_value = "5m",
          value_parser = timeout_between_1s_and_1h)]
    pub(crate) compile_timeout: std::time::Duration,
    /// The compile flags given on the command line (not from the environment or
    /// the defaults), named, for the warning that a daemon does not apply them.
    #[arg(skip)]
    pub(crate) compile_flags_given: Vec<&'static str>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

impl Cli {
    /// The command line, parsed (clap exits with 2 on usage errors, 0 for
    /// --help and --version), with the compile flags it names.
    fn parse_args() -> Cli {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command().get_matches();
        let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        let on_command_line = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        cli.compile_flags_given =
            [("compile_memory_mib", "--compile-memory-mib"), ("compile_timeout", "--compile-timeout")]
                .into_iter()
                .filter(|(id, _)| on_command_line(id))
                .map(|(_, flag)| flag)
                .collect();
        cli
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Register, list and remove provider components.
    #[command(subcommand)]
    Provider(ProviderCommand),
    /// Start, list, stop and maintain instances through a provider.
    #[command(subcommand)]
    Instance(InstanceCommand),
    /// Report the machine lock (holder, waiting, history), or hold it around a program.
    Lock(lock::LockArgs),
    /// Check the state file, or make a new one of what a damaged one still holds.
    /// Both need the state to themselves: stop the daemon first.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Run as a daemon: the HTTP/JSON API on a unix socket (DATA_DIR/broker.sock,
    /// mode 0600) until SIGTERM or Ctrl-C, then finish the requests in flight.
    /// Routes: /healthz, /metrics, /v1/providers[/NAME[/swap]], /v1/instances[/ID[/maintain]]
    /// (starting streams NDJSON status lines), /v1/events, /v1/lock, /openapi.json.
    /// On start it reconciles: maintain-instance for each recorded instance, and
    /// each provider's instances compared with the records (an event per provider).
    /// It also finishes what a killed host left in flight: a start recorded as
    /// pending is adopted if the provider reports the id it claimed, a stop
    /// marked is finished, and unknown instances are harvested per --harvest.
    Serve {
        /// Also serve on this loopback TCP address (e.g. 127.0.0.1:7070); every
        /// request but /healthz must then carry `Authorization: Bearer <token>`.
        #[arg(long, requires = "token_file", value_name = "ADDR")]
        listen: Option<std::net::SocketAddr>,
        /// The bearer token for --listen: a file only its owner can read, at least 16 characters.
        #[arg(long, requires = "listen", value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Watch this directory (default DATA_DIR/providers): a manifest dropped in
        /// (NAME.toml or NAME/provider.toml) is added, its component changed is swapped
        /// in, the manifest changed is reloaded, the manifest removed unregisters the
        /// provider once its calls in flight finish. Refusals are events.
        #[arg(long, value_name = "DIR")]
        providers_dir: Option<PathBuf>,
        /// Most MiB of providers' kv the daemon keeps in memory together. Past it, the
        /// least recently used namespaces with nothing left to persist are let go and
        /// read again from the state file on their next use (about 0.75 ms a MiB).
        #[arg(long, value_name = "MIB", default_value_t = broker_core::store::MIRROR_BUDGET_BYTES as u64 >> 20)]
        kv_mirror_mib: u64,
        /// A request's line and headers must arrive within this (and an idle
        /// kept-alive connection closes after it), e.g. 10s.
        #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = timeout_between_1s_and_1h)]
        header_timeout: std::time::Duration,
        /// A request's body must arrive whole within this (else 408).
        #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = timeout_between_1s_and_1h)]
        body_timeout: std::time::Duration,
        /// Connections open at once, per listener; more wait in the kernel's backlog.
        #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65536))]
        max_connections: u32,
        /// On SIGTERM, how long requests in flight, and starts or swaps whose client
        /// went away, have to finish before they are cut short (1s to 1h).
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = timeout_between_1s_and_1h)]
        drain_timeout: std::time::Duration,
        /// Which instances the start-up reconcile stops (Juju's provisioner-harvest-mode):
        /// `destroyed` finishes the stops a killed host left unfinished; `unknown`
        /// stops instances the providers report and no record claims (after a complete
        /// inventory, before the provider starts anything new); `all` does both;
        /// `none` stops nothing and only reports.
        #[arg(long, value_enum, value_name = "MODE", default_value_t = broker_core::broker::reconcile::HarvestMode::Destroyed)]
        harvest: broker_core::broker::reconcile::HarvestMode,
        /// Also speak InfraKit's plugin protocol, so InfraKit's tools drive this host: a
        /// unix socket `group` (Group/0.1.1) and one per provider, named after it
        /// (Instance/0.6.1), in DIR (given without DIR: ~/.infrakit/plugins, InfraKit's
        /// own). Mode 0600; removed when the daemon stops.
        #[arg(long, value_name = "DIR", num_args = 0..=1)]
        infrakit_dir: Option<Option<PathBuf>>,
        /// Between convergence passes of a group when nothing wakes it sooner (1s to 1h).
        #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = timeout_between_1s_and_1h)]
        group_poll: std::time::Duration,
        /// Most starts or stops one group's pass has in flight at once.
        #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
        group_max_parallel: u16,
    },
    /// Groups (InfraKit's group plugin): keep N instances of a template alive
    /// on a provider, or one per logical id, and roll them to a new template.
    #[command(subcommand)]
    Group(groups::GroupCommand),
    /// The event log: providers added, swapped (both versions' hashes), refused, removed.
    Events {
        /// Only events after this sequence number.
        #[arg(long, default_value_t = 0)]
        after: u64,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum StoreCommand {
    /// Read every table of DATA_DIR/state.redb, read-only, every record decoded,
    /// and say what cannot be read. Exit 0 when all can, 1 otherwise.
    Check {
        #[arg(long)]
        json: bool,
    },
    /// Copy what can be read of DATA_DIR/state.redb into a new state file, in
    /// its place; the damaged one's bytes are kept as state.redb.damaged-SECONDS. Records
    /// that do not decode are left out and named; a table is copied up to its
    /// first unreadable entry. The write-ahead log is applied on the next open.
    Recover {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum ProviderCommand {
    /// Check a provider's manifest and component (sha256 pin, imports against
    /// grants, contract version, validate-config) and register it.
    Add {
        /// Path to the provider's provider.toml.
        manifest: PathBuf,
    },
    /// List registered providers.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show a provider: version, component hash, isolation, limits, per-method
    /// deadlines and the effective grants.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Unregister a provider that has no recorded instances.
    Remove { name: String },
    /// Replace a provider's component while it serves. The candidate is compiled,
    /// linked and type-checked, its validate-config runs on the live config and,
    /// with --check, the conformance scenarios run in the sandbox; only then is it
    /// swapped in. Calls in flight finish on the old version. A refused candidate
    /// changes nothing (exit 1, with the reason).
    Swap {
        name: String,
        /// The new component (.wasm); it is kept in the data dir under its hash.
        component: PathBuf,
        /// Also run the conformance scenarios on the candidate before swapping.
        #[arg(long)]
        check: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write a new provider crate to DIR (default ./NAME), outside any
    /// workspace: the SDK as its dependency, the wasm32-wasip2 target and its
    /// stack size, a provider that keeps its instances in kv, its manifest, an
    /// (empty) kit script and a README. It builds with `cargo build --release`
    /// and passes `broker provider test --strict` as written.
    New {
        /// The provider's name: lowercase letters, digits and '-', a letter first.
        name: String,
        /// Where to write it (must not exist, or be empty).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The SDK crate's directory (default: the one this `broker` was built beside).
        #[arg(long, value_name = "DIR", conflicts_with = "sdk_git")]
        sdk: Option<PathBuf>,
        /// The SDK from this git repository instead (cargo finds `broker-guest` in it).
        #[arg(long, value_name = "URL")]
        sdk_git: Option<String>,
        /// With --sdk-git: the revision (a tag or commit).
        #[arg(long, value_name = "REV", requires = "sdk_git")]
        sdk_rev: Option<String>,
    },
    /// Call one method of a provider and print its typed answer as JSON. Of a
    /// component file (a path): in the kit's sandbox, on simulated capabilities
    /// (its script), a fresh sandbox each call, so nothing carries over from one
    /// to the next. Of a registered provider (a name): a method that changes
    /// nothing the host records (describe, validate-config, all-instances).
    /// Status updates go to stderr.
    Call {
        /// A registered provider's name, or a component file (.wasm).
        target: String,
        /// describe, validate-config, start-instance, stop-instances,
        /// all-instances or maintain-instance.
        method: String,
        /// The method's params as JSON (or @FILE): start-instance's
        /// StartInstanceParams (as `instance start --params`), stop-instances' ids
        /// (["a","b"]), all-instances' page ({"cursor":null,"size":10}; none:
        /// every page), maintain-instance's {"id":…,"params":{…}}, validate-config's
        /// config (none: the manifest's).
        #[arg(long, value_name = "JSON")]
        params: Option<String>,
        /// With a component file: its manifest (grants, limits, config); without
        /// one, kv and log are granted and the config is empty.
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// With a component file: the script of simulated answers (default:
        /// `<manifest stem>.script.json` beside the manifest).
        #[arg(long, value_name = "FILE")]
        script: Option<PathBuf>,
    },
    /// Run the conformance scenarios against a component in the sandbox, on
    /// simulated capabilities (no real infrastructure). Exit 0 only if all pass.
    Test {
        /// The component to test.
        component: PathBuf,
        /// Its manifest (limits, grants, config); the component path in it is
        /// replaced by COMPONENT. Without one: kv and log granted, empty config.
        #[arg(long)]
        manifest: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = ReportFormat::Text)]
        format: ReportFormat,
        /// The script of simulated answers: HTTP answers, program runs and their
        /// output, children and what they answer on their sockets, host network
        /// devices (default: `<manifest stem>.script.json` beside the manifest).
        #[arg(long, value_name = "FILE", conflicts_with = "record")]
        script: Option<PathBuf>,
        /// Run against the real capabilities the manifest grants (endpoints,
        /// programs, children, devices) and write what they answered to FILE:
        /// a real run becomes a replayable script.
        #[arg(long, value_name = "FILE")]
        record: Option<PathBuf>,
        /// With --record: give the component the real values of the secrets its
        /// manifest names (DATA_DIR/secrets/NAME/…); without it, their stand-ins
        /// (kit-secret:NAME). Only for a component you trust with them.
        #[arg(long, requires = "record")]
        with_secrets: bool,
        /// A host call the script does not answer fails the case it happened in.
        #[arg(long)]
        strict: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum InstanceCommand {
    /// Start an instance. Status updates are shown as they happen on stderr: one
    /// line redrawn in a terminal, a line each otherwise, JSON lines with --json.
    Start(StartArgs),
    /// List instances as the providers report them, joined with the host's records.
    List {
        /// Only this provider's instances.
        #[arg(long)]
        provider: Option<String>,
        #[arg(long)]
        json: bool,
        /// At most this many (sorted by provider, then id); the cursor of the
        /// next page is printed on stderr if more remain.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        limit: Option<u64>,
        /// Only those after this cursor (PROVIDER/ID).
        #[arg(long, value_name = "CURSOR")]
        after: Option<String>,
    },
    /// Stop instances, idempotently (as Juju's StopInstances): the known ids are
    /// stopped, one call per provider; an id the host has no record of (never
    /// started, or stopped already) is reported and is not a failure. Exit 1 only
    /// if a provider failed to stop one, after every other id was tried.
    Stop {
        #[arg(required = true)]
        ids: Vec<String>,
        /// The provider to ask; needed only for ids the host has no record of.
        #[arg(long)]
        provider: Option<String>,
    },
    /// Run a provider's maintain-instance on an existing instance.
    Maintain {
        id: String,
        #[arg(long)]
        provider: Option<String>,
    },
}

#[derive(Debug, Args)]
pub(crate) struct StartArgs {
    /// The registered provider to start it with.
    #[arg(long)]
    provider: String,
    /// Juju constraints, e.g. "mem=2G cores=2 arch=amd64 tags=a,b zones=z1,z2".
    #[arg(long, default_value = "")]
    constraints: String,
    /// A placement directive, e.g. zone=z1.
    #[arg(long)]
    placement: Option<String>,
    /// cloud-init user data for the instance, read from FILE (at most 48 KiB).
    #[arg(long, value_name = "FILE")]
    user_data: Option<PathBuf>,
    /// An instance tag, KEY=VALUE; give it again for more (the provider puts them
    /// on the instance: EC2 tags, LXD user.* keys).
    #[arg(long = "tag", value_name = "KEY=VALUE")]
    tags: Vec<String>,
    /// The whole StartInstanceParams as JSON from FILE (the API's `params`; any
    /// field left out is empty, an unknown one is an error; at most 64 KiB).
    /// --placement, --user-data and --tag apply over it; --constraints
    /// replaces its constraints.
    #[arg(long, value_name = "FILE")]
    params: Option<PathBuf>,
    /// Print the result as JSON on stdout, and each status update as a JSON line
    /// on stderr (as the API streams them).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ReportFormat {
    Text,
    Json,
    /// JUnit XML, for CI systems.
    Junit,
}

/// The largest `--params` file read (the daemon takes requests of 64 KiB).
const MAX_PARAMS_FILE: usize = 64 << 10;

/// A file the user named, read whole if it is a regular file of at most `max` bytes.
pub(crate) fn read_bounded(path: &std::path::Path, max: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(max as u64 + 1).read_to_end(&mut bytes)?;
    if bytes.len() > max {
        return Err(std::io::Error::other(format!("larger than {max} bytes")));
    }
    Ok(bytes)
}

/// A mistake in how the command was called (exit code 2), found after parsing.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct UsageError(pub String);

/// A daemon timeout: 1 s to 1 h (0 would cut every client off; a huge one
/// overflows the timer's arithmetic).
fn timeout_between_1s_and_1h(text: &str) -> Result<std::time::Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if !(std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(3600)).contains(&duration) {
        return Err(format!("{text} is not between 1s and 1h"));
    }
    Ok(duration)
}

fn default_data_dir() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".local/share/wasm-broker"),
        None => PathBuf::from("/var/lib/wasm-broker"),
    }
}

/// Run the CLI; returns the exit code of a successful run (errors exit 1, or 2
/// for a [`UsageError`]).
pub(crate) async fn run(mut cli: Cli) -> Result<u8> {
    let mut stdout = std::io::stdout().lock();
    // Made absolute once, here: the component cache, the daemon and the
    // sandbox all need absolute paths, and a relative one would mean another
    // place to a process started elsewhere.
    cli.data_dir = std::path::absolute(&cli.data_dir)
        .with_context(|| format!("cannot resolve --data-dir {}", cli.data_dir.display()))?;
    if let Some(socket) = &cli.socket {
        cli.socket =
            Some(std::path::absolute(socket).with_context(|| format!("cannot resolve --socket {}", socket.display()))?);
    }
    // The lock commands never open the state database, which another broker may hold,
    // and a conformance run uses a sandbox of its own.
    if let Command::Lock(args) = cli.command {
        return lock::run(&cli.data_dir, args, &mut stdout).await;
    }
    if let Command::Provider(ProviderCommand::Test {
        component,
        manifest,
        format,
        script,
        record,
        with_secrets,
        strict,
    }) = cli.command
    {
        let answers = TestAnswers { script, record, with_secrets, strict };
        return provider_test(&cli.data_dir, &component, manifest.as_deref(), format, answers, &mut stdout).await;
    }
    if let Command::Provider(ProviderCommand::New { name, dir, sdk, sdk_git, sdk_rev }) = cli.command {
        return provider_new(&name, dir, sdk, sdk_git, sdk_rev, &mut stdout);
    }
    if let Command::Provider(ProviderCommand::Call { target, method, params, manifest, script }) = &cli.command
        && is_component_path(target)
    {
        let call = OneCall::parse(method, params.as_deref())?;
        return provider_call_file(Path::new(target), manifest.as_deref(), script.as_deref(), call, &mut stdout).await;
    }
    let socket = cli.socket.clone().unwrap_or_else(|| crate::daemon::default_socket(&cli.data_dir));
    if let Command::Store(command) = cli.command {
        return store_command(&cli.data_dir, &socket, command, &mut stdout).await;
    }
    if let Command::Serve {
        listen,
        token_file,
        providers_dir,
        kv_mirror_mib,
        header_timeout,
        body_timeout,
        max_connections,
        drain_timeout,
        harvest,
        infrakit_dir,
        group_poll,
        group_max_parallel,
    } = cli.command
    {
        let providers_dir = providers_dir.unwrap_or_else(|| cli.data_dir.join("providers"));
        let kv_mirror_bytes = usize::try_from(kv_mirror_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        let limits = crate::daemon::ServeLimits {
            header_timeout,
            body_timeout,
            max_connections: max_connections as usize,
            drain: drain_timeout,
        };
        let infrakit_dir = match infrakit_dir {
            None => None,
            Some(Some(dir)) => Some(dir),
            Some(None) => Some(crate::infrakit::default_dir().ok_or_else(|| {
                UsageError("--infrakit-dir without DIR needs $HOME (for ~/.infrakit/plugins)".into())
            })?),
        };
        let groups = broker_core::groups::GroupSettings {
            poll: group_poll,
            max_parallel: usize::from(group_max_parallel),
            ..Default::default()
        };
        let options =
            ServeOptions { listen, token_file, providers_dir, kv_mirror_bytes, limits, harvest, infrakit_dir, groups };
        serve(&cli.data_dir, &socket, options).await?;
        return Ok(0);
    }
    let backend = Backend::open(&cli.data_dir, &socket).await?;
    if !cli.compile_flags_given.is_empty()
        && matches!(backend, Backend::Daemon(_))
        && matches!(cli.command, Command::Provider(ProviderCommand::Add { .. } | ProviderCommand::Swap { .. }))
    {
        let (flags, verb) = match cli.compile_flags_given.as_slice() {
            [flag] => (flag.to_string(), "is"),
            flags => (flags.join(" and "), "are"),
        };
        eprintln!(
            "warning: {flags} {verb} not applied: the daemon on {} compiles components with the limits it was \
             started with (give them to `broker serve`)",
            socket.display()
        );
    }
    match cli.command {
        Command::Provider(command) => provider(&backend, command, &mut stdout).await?,
        Command::Instance(command) => instance(&backend, command, &mut stdout).await?,
        Command::Group(command) => groups::run(&backend, command, &mut stdout).await?,
        Command::Lock(_) | Command::Serve { .. } | Command::Store(_) => unreachable!("handled above"),
        Command::Events { after, limit, json } => {
            let events = backend.events(after, limit).await?;
            if json {
                for event in &events {
                    writeln!(stdout, "{}", output::json_line(event)?)?;
                }
            } else {
                output::event_lines(&mut stdout, &events)?;
            }
        }
    }
    Ok(0)
}

/// `broker serve`'s options, as parsed.
struct ServeOptions {
    listen: Option<std::net::SocketAddr>,
    token_file: Option<PathBuf>,
    providers_dir: PathBuf,
    kv_mirror_bytes: usize,
    limits: crate::daemon::ServeLimits,
    harvest: broker_core::broker::reconcile::HarvestMode,
    infrakit_dir: Option<PathBuf>,
    groups: broker_core::groups::GroupSettings,
}

/// What is the operator's to fix (exit 2) is checked here; the daemon itself
/// is composed in one place, [`crate::daemon::run`].
async fn serve(data_dir: &std::path::Path, socket: &std::path::Path, options: ServeOptions) -> Result<()> {
    let ServeOptions { listen, token_file, providers_dir, kv_mirror_bytes, limits, harvest, infrakit_dir, groups } =
        options;
    // Before the state is opened: a second daemon would only be told the database is busy.
    if crate::client::DaemonClient::probe(socket).await.is_some() {
        anyhow::bail!("another broker daemon is serving on {}", socket.display());
    }
    let tcp = match (listen, token_file) {
        (Some(addr), Some(file)) => {
            crate::daemon::check_loopback(addr).map_err(|e| UsageError(e.to_string()))?;
            let token = crate::daemon::BearerToken::load(&file).map_err(|e| UsageError(e.to_string()))?;
            // Bound first, before the state is opened or any provider runs:
            // a port someone else holds refuses the start, naming them.
            Some(crate::daemon::TcpListen::bind(addr, token)?)
        }
        _ => None,
    };
    let serving = crate::daemon::Serving { tcp, infrakit_dir, groups };
    let options = crate::daemon::DaemonOptions { providers_dir, kv_mirror_bytes, limits, harvest, serving };
    crate::daemon::run(data_dir, socket, options).await
}

async fn provider(backend: &Backend, command: ProviderCommand, out: &mut impl Write) -> Result<()> {
    match command {
        ProviderCommand::Add { manifest } => {
            let record = backend
                .add_provider(&manifest)
                .await
                .with_context(|| format!("cannot add provider from {}", manifest.display()))?;
            let text =
                format!("added provider {} {} (sha256 {})", record.name, record.version, record.component_sha256);
            output::line(out, &text)?;
        }
        ProviderCommand::List { json } => {
            let records = backend.list_providers().await?;
            if json {
                writeln!(out, "{}", output::json_pretty(&records)?)?;
            } else {
                output::provider_table(out, &records)?;
            }
        }
        ProviderCommand::Show { name, json } => {
            let view = backend.show_provider(&name).await?;
            if json {
                writeln!(out, "{}", output::json_pretty(&view)?)?;
            } else {
                output::provider_details(out, &view)?;
            }
        }
        ProviderCommand::Test { .. } | ProviderCommand::New { .. } => {
            unreachable!("handled before the state is opened")
        }
        ProviderCommand::Call { target, method, params, manifest, script } => {
            if manifest.is_some() || script.is_some() {
                let why =
                    format!("--manifest and --script are for a component file; {target:?} names a registered provider");
                return Err(UsageError(why).into());
            }
            let call = OneCall::parse(&method, params.as_deref())?;
            let answer = backend.call_provider(&target, call.method, call.params.as_ref()).await?;
            writeln!(out, "{}", output::json_pretty(&answer)?)?;
        }
        ProviderCommand::Swap { name, component, check, json } => {
            let report = backend.swap(&name, &component, check).await?;
            if json {
                writeln!(out, "{}", output::json_pretty(&report)?)?;
            } else {
                let text = format!(
                    "swapped provider {name}: {} ({}) -> {} ({}){}",
                    report.old_version,
                    broker_core::store::records::short_sha256(&report.old_sha256),
                    report.new_version,
                    broker_core::store::records::short_sha256(&report.new_sha256),
                    if report.checked { ", conformance passed" } else { "" }
                );
                output::line(out, &text)?;
            }
        }
        ProviderCommand::Remove { name } => {
            backend.remove_provider(&name).await.with_context(|| format!("cannot remove provider {name}"))?;
            output::line(out, &format!("removed provider {name}"))?;
        }
    }
    Ok(())
}

async fn instance(backend: &Backend, command: InstanceCommand, out: &mut impl Write) -> Result<()> {
    match command {
        InstanceCommand::Start(args) => {
            // Checked here, whoever runs it: a typo is a usage error, not a failed start.
            constraints::parse(&args.constraints)
                .map_err(|e| UsageError(format!("invalid --constraints {:?}: {e}", args.constraints)))?;
            let read = |flag: &str, path: &std::path::Path, max: usize| {
                read_bounded(path, max).map_err(|e| UsageError(format!("{flag} {}: {e}", path.display())))
            };
            let user_data = match &args.user_data {
                Some(path) => Some(read("--user-data", path, broker_capabilities::contract::start::MAX_USER_DATA)?),
                None => None,
            };
            let params = match &args.params {
                Some(path) => Some(
                    serde_json::from_slice::<serde_json::Value>(&read("--params", path, MAX_PARAMS_FILE)?)
                        .map_err(|e| UsageError(format!("--params {}: not JSON: {e}", path.display())))?,
                ),
                None => None,
            };
            let tags = (args.tags.iter())
                .map(|t| {
                    broker_capabilities::contract::start::parse_tag(t).map_err(|e| UsageError(format!("--tag: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let request = backend::StartRequest {
                provider: &args.provider,
                constraints: &args.constraints,
                placement: args.placement.as_deref(),
                user_data,
                tags,
                params,
            };
            // The same checks the daemon makes, before anything is sent.
            broker_capabilities::contract::start::start_params(request.input())
                .map_err(|e| UsageError(e.to_string()))?;
            let progress = std::sync::Arc::new(output::Progress::new(&args.provider, args.json));
            let shown = progress.clone();
            let started = backend.start_instance(&request, move |event| shown.show(&event)).await;
            progress.finish();
            let record =
                started.with_context(|| format!("cannot start an instance with provider {}", args.provider))?;
            if args.json {
                writeln!(out, "{}", output::json_pretty(&output::InstanceView::from(&record))?)?;
            } else {
                let text = format!("started {} ({}): {}", record.id, record.provider, record.hardware.juju_text());
                output::line(out, &text)?;
            }
        }
        InstanceCommand::List { provider, json, limit, after } => {
            if after.as_deref().is_some_and(|after| !after.contains('/')) {
                return Err(UsageError("--after takes a cursor, PROVIDER/ID".into()).into());
            }
            let records = backend.list_instances(provider.as_deref()).await.context("cannot list instances")?;
            let limit = limit.map(|limit| usize::try_from(limit).unwrap_or(usize::MAX));
            let (records, next) = broker_core::broker::page(records, after.as_deref(), limit);
            if let Some(next) = next {
                eprintln!("more: --after {}", broker_capabilities::error_text::escape_unprintable(&next));
            }
            let views: Vec<output::InstanceView> = records.iter().map(output::InstanceView::from).collect();
            if json {
                writeln!(out, "{}", output::json_pretty(&views)?)?;
            } else {
                output::instance_table(out, &views)?;
            }
        }
        InstanceCommand::Stop { ids, provider } => {
            // Idempotent, as Juju's StopInstances: what is known is stopped, an
            // unknown id is reported and is no failure; a failure fails the command,
            // after every other id was tried.
            let report = backend.stop_instances(ids, provider.as_deref()).await;
            for (id, owner) in &report.stopped {
                output::line(out, &format!("stopped {id} ({owner})"))?;
            }
            for id in &report.unknown {
                output::line(
                    out,
                    &format!("{id}: no such instance, recorded or reported by a provider (nothing to stop)"),
                )?;
            }
            // The first failure keeps its cause (and so its kind and exit code); the others are named with it.
            let mut failed = report.failed.into_iter();
            if let Some((ids, first)) = failed.next() {
                let others: Vec<String> = failed.map(|(ids, why)| format!("cannot stop {ids}: {why:#}; ")).collect();
                return Err(first.context(format!("{}cannot stop {ids}", others.concat())));
            }
        }
        InstanceCommand::Maintain { id, provider } => {
            let owner = backend
                .maintain_instance(&id, provider.as_deref())
                .await
                .with_context(|| format!("cannot maintain {id}"))?;
            output::line(out, &format!("maintained {id} ({owner})"))?;
        }
    }
    Ok(())
}

/// Text of a status event, as the CLI prints it.
pub(crate) fn describe_event(event: &CallEvent) -> String {
    match event {
        CallEvent::Status { status, info, .. } if info.is_empty() => status_name(*status).to_owned(),
        CallEvent::Status { status, info, .. } => format!("{}: {info}", status_name(*status)),
        CallEvent::Cleanup { info } => format!("cleanup: {info}"),
    }
}

/// `broker provider new`.
fn provider_new(
    name: &str,
    dir: Option<PathBuf>,
    sdk: Option<PathBuf>,
    sdk_git: Option<String>,
    sdk_rev: Option<String>,
    out: &mut impl Write,
) -> Result<u8> {
    use scaffold::SdkSource;
    let source = match (sdk, sdk_git) {
        (Some(path), _) => {
            if !path.join("Cargo.toml").is_file() {
                return Err(UsageError(format!("--sdk {}: no Cargo.toml there", path.display())).into());
            }
            SdkSource::Path(
                std::path::absolute(&path).with_context(|| format!("cannot resolve --sdk {}", path.display()))?,
            )
        }
        (None, Some(url)) => SdkSource::Git { url, rev: sdk_rev },
        (None, None) => SdkSource::built_beside().ok_or_else(|| {
            UsageError(
                "the SDK this broker was built beside is not there any more: give --sdk DIR or --sdk-git URL".into(),
            )
        })?,
    };
    let dir = dir.unwrap_or_else(|| PathBuf::from(name));
    let written = scaffold::write(name, &dir, &source)?;
    for path in &written {
        output::line(out, &format!("wrote {}", path.display()))?;
    }
    let next = format!(
        "next: cd {} && cargo build --release && broker provider test target/wasm32-wasip2/release/{}.wasm --manifest provider.toml --strict",
        dir.display(),
        name.replace('-', "_")
    );
    output::line(out, &next)?;
    Ok(0)
}

/// Whether `provider call`'s target is a component file rather than a
/// registered provider's name (which has no `/` and no `.wasm`).
fn is_component_path(target: &str) -> bool {
    target.contains('/') || target.ends_with(".wasm")
}

/// `provider call`'s method and params, checked before anything runs.
struct OneCall {
    method: broker_core::manifest::Method,
    params: Option<serde_json::Value>,
}

impl OneCall {
    fn parse(method: &str, params: Option<&str>) -> Result<OneCall> {
        let method = broker_core::version::by_name::method_named(method).map_err(|e| UsageError(e.to_string()))?;
        let params = match params {
            None => None,
            Some(text) => {
                let bytes = match text.strip_prefix('@') {
                    Some(file) => read_bounded(Path::new(file), MAX_PARAMS_FILE)
                        .map_err(|e| UsageError(format!("--params {text}: {e}")))?,
                    None => text.as_bytes().to_vec(),
                };
                let value =
                    serde_json::from_slice(&bytes).map_err(|e| UsageError(format!("--params: not JSON: {e}")))?;
                Some(value)
            }
        };
        Ok(OneCall { method, params })
    }
}

/// The manifest a component file runs under in the sandbox: `manifest` with
/// its component replaced by the file, or one granting kv and log.
fn sandbox_manifest(component: &Path, manifest: Option<&Path>) -> Result<broker_core::manifest::Manifest> {
    use broker_core::manifest::Manifest;
    let mut loaded = match manifest {
        Some(path) => Manifest::load(path).with_context(|| format!("cannot read manifest {}", path.display()))?,
        None => {
            let name = component
                .file_stem()
                .map(|s| s.to_string_lossy().to_lowercase().replace(['_', '.'], "-"))
                .unwrap_or_else(|| "candidate".into());
            let text = format!("name = {name:?}\ncomponent = \"x\"\n[grants]\nkv = true\nlog = true\n");
            Manifest::parse(Path::new("provider.toml"), &text).map_err(|e| UsageError(e.to_string()))?
        }
    };
    loaded.component = component.to_owned();
    Ok(loaded)
}

/// The script `--script` names, or the one beside the manifest.
fn scripted_options(
    loaded: &broker_core::manifest::Manifest,
    script: Option<&Path>,
) -> Result<broker_core::conformance::KitOptions> {
    use broker_core::conformance::{Answers, KitOptions};
    match script {
        Some(path) => {
            let script = broker_core::conformance::load_script(path).map_err(|e| UsageError(e.to_string()))?;
            Ok(KitOptions {
                answers: Answers::Script(std::sync::Arc::new(script)),
                strict: false,
                sandbox: Default::default(),
                credentials: None,
                secrets: None,
            })
        }
        None => Ok(KitOptions::beside(loaded).map_err(|e| UsageError(e.to_string()))?),
    }
}

/// `broker provider call FILE METHOD`: one call in a throwaway sandbox.
async fn provider_call_file(
    component: &Path,
    manifest: Option<&Path>,
    script: Option<&Path>,
    call: OneCall,
    out: &mut impl Write,
) -> Result<u8> {
    let loaded = sandbox_manifest(component, manifest)?;
    let options = scripted_options(&loaded, script)?;
    let name = loaded.name().to_owned();
    let hooks = CallHooks::with_events(move |event| {
        let described = describe_event(&event);
        eprintln!("[{name}] {}", broker_capabilities::error_text::escape_unprintable(&described));
    });
    let answered =
        broker_core::conformance::call_in_sandbox(&loaded, options, call.method, call.params.as_ref(), &hooks)
            .await
            .with_context(|| format!("cannot load {} into the sandbox", component.display()))?;
    for unanswered in &answered.unanswered {
        eprintln!(
            "note: the script did not answer {}",
            broker_capabilities::error_text::escape_unprintable(unanswered)
        );
    }
    for denied in &answered.denied {
        eprintln!("note: refused for want of a grant: {}", broker_capabilities::error_text::escape_unprintable(denied));
    }
    let answer = answered.answer.map_err(|e| match e {
        broker_core::version::by_name::ByNameError::Call(call) => anyhow::Error::from(call),
        refused => broker_core::broker::BrokerServiceError::ByName(refused).into(),
    })?;
    writeln!(out, "{}", output::json_pretty(&answer)?)?;
    Ok(0)
}

/// `broker provider test`'s choice of scripted (or recorded) answers.
struct TestAnswers {
    script: Option<PathBuf>,
    record: Option<PathBuf>,
    with_secrets: bool,
    strict: bool,
}

async fn provider_test(
    data_dir: &std::path::Path,
    component: &std::path::Path,
    manifest: Option<&std::path::Path>,
    format: ReportFormat,
    answers: TestAnswers,
    out: &mut impl Write,
) -> Result<u8> {
    use broker_core::conformance::{Answers, KitOptions, Recording};
    let loaded = sandbox_manifest(component, manifest)?;
    let recording = answers.record.as_ref().map(|_| std::sync::Arc::new(Recording::default()));
    if answers.record.is_some() {
        eprintln!(
            "recording: the scenarios run against the real endpoints, programs and devices the manifest \
             grants, and make real instances (tagged {}=run-…); the run stops only instances its own starts \
             made, never one that was there before it",
            broker_core::conformance::RECORDING_TAG
        );
    }
    let mut options = match (&answers.script, &recording) {
        (_, Some(recording)) => KitOptions {
            answers: Answers::Record(recording.clone()),
            strict: false,
            sandbox: Default::default(),
            credentials: None,
            secrets: None,
        },
        (script, None) => scripted_options(&loaded, script.as_deref())?,
    };
    options.strict = answers.strict;
    // The machine's `[sandbox]` (bubblewrap, uid base) applies to a recording's programs too.
    options.sandbox =
        broker_core::broker::service::HostConfig::load(data_dir).map_err(|e| UsageError(e.to_string()))?.sandbox;
    // A recording signs with the host's own credentials, as the daemon would,
    // and fills in the provider's secrets from the host's (stand-ins in what it writes).
    options.credentials = Some(data_dir.join(broker_capabilities::rooms::http_egress::signing::CREDENTIALS_DIR));
    if recording.is_some() && !loaded.secrets.is_empty() {
        let names: Vec<&str> = loaded.secrets.iter().map(|(_, name)| name.as_str()).collect();
        let dir = format!("DATA_DIR/{}/{}/", broker_capabilities::secrets::SECRETS_DIR, loaded.name());
        // The manifest's own name picks the dir: a candidate could claim another provider's.
        if answers.with_secrets {
            options.secrets = Some(data_dir.join(broker_capabilities::secrets::SECRETS_DIR));
            eprintln!(
                "warning: --with-secrets gives this component the secrets {} of {dir} (the script and reports hold \
                 stand-ins)",
                names.join(", ")
            );
        } else {
            eprintln!(
                "note: the component gets stand-ins (kit-secret:NAME) for the secrets {} of {dir}; \
                 --with-secrets gives it their values",
                names.join(", ")
            );
        }
    }
    if let Some(first) = loaded.inline_secrets.first() {
        eprintln!(
            "warning: config.{first} looks like a secret given inline: it is hidden from the report, but \
             `provider add` refuses it; name it under [secrets] (DATA_DIR/{}/{}/NAME)",
            broker_capabilities::secrets::SECRETS_DIR,
            loaded.name()
        );
    }
    let report = broker_core::conformance::run_with(&loaded, options)
        .await
        .with_context(|| format!("cannot load {} into the sandbox", component.display()))?;
    if let (Some(path), Some(recording)) = (&answers.record, &recording) {
        let script = recording.script();
        std::fs::write(path, report.redacted_json(&script))
            .with_context(|| format!("cannot write the recorded script {}", path.display()))?;
        // On stderr: the report alone goes to stdout, whatever its format.
        let counts: Vec<String> = script
            .iter()
            .map(|(section, value)| format!("{} {section}", value.as_array().map_or(1, Vec::len)))
            .collect();
        let counts = if counts.is_empty() { "nothing".to_owned() } else { counts.join(", ") };
        eprintln!("recorded {counts} to {}", path.display());
    }
    match format {
        ReportFormat::Text => write!(out, "{}", report.text())?,
        ReportFormat::Json => writeln!(out, "{}", output::json_pretty(&report)?)?,
        ReportFormat::Junit => write!(out, "{}", report.junit())?,
    }
    Ok(if report.passed() { 0 } else { 1 })
}

/// `broker store check` / `recover`: on the state file itself, never through a daemon.
async fn store_command(
    data_dir: &std::path::Path,
    socket: &std::path::Path,
    command: StoreCommand,
    out: &mut impl Write,
) -> Result<u8> {
    if crate::client::DaemonClient::probe(socket).await.is_some() {
        anyhow::bail!("a broker daemon is serving on {}: stop it first (it holds the state file)", socket.display());
    }
    let recovering = matches!(command, StoreCommand::Recover { .. });
    let dir = data_dir.to_owned();
    let json = match command {
        StoreCommand::Check { json } | StoreCommand::Recover { json } => json,
    };
    // Reads the whole file: off the async workers.
    let report = tokio::task::spawn_blocking(move || {
        if recovering { broker_core::store::salvage::recover(&dir) } else { broker_core::store::salvage::check(&dir) }
    })
    .await
    .context("the store check failed")??;
    if json {
        writeln!(out, "{}", output::json_pretty(&report)?)?;
    } else {
        output::salvage_report(out, &report)?;
    }
    if recovering {
        // `recover` opened the new file as a store: the log applied, the id index made.
        if report.with_log.is_none() {
            return Ok(1);
        }
        output::line(out, "the new state file opens; the write-ahead log is applied")?;
        return Ok(0);
    }
    Ok(if report.is_sound() { 0 } else { 1 })
}

/// Whether the command was asked for JSON: then a failure is printed as JSON
/// on stdout too, `{"error": {"kind", "message", …}}`.
fn wants_json(command: &Command) -> bool {
    match command {
        Command::Events { json, .. }
        | Command::Store(StoreCommand::Check { json } | StoreCommand::Recover { json })
        | Command::Provider(
            ProviderCommand::List { json } | ProviderCommand::Show { json, .. } | ProviderCommand::Swap { json, .. },
        )
        | Command::Instance(InstanceCommand::List { json, .. }) => *json,
        Command::Instance(InstanceCommand::Start(args)) => args.json,
        Command::Provider(ProviderCommand::Test { format, .. }) => matches!(format, ReportFormat::Json),
        // Its answer is JSON: so is its failure.
        Command::Provider(ProviderCommand::Call { .. }) => true,
        Command::Group(command) => command.json(),
        Command::Lock(args) => args.json,
        _ => false,
    }
}

/// A failed command's error as the host reports it: the daemon's own report
/// if it refused, else the kind of the first error in the chain the host
/// classifies; the message is the whole chain's.
pub(crate) fn error_report(error: &anyhow::Error) -> ErrorReport {
    use broker_capabilities::error_text::chain_text;
    let message = chain_text(error.chain());
    if let Some(client) = error.chain().find_map(|cause| cause.downcast_ref::<crate::client::ClientError>()) {
        return ErrorReport { message, ..client.report() };
    }
    if error.chain().any(|cause| cause.is::<UsageError>()) {
        return ErrorReport::new(ErrorKind::BadRequest, message);
    }
    ErrorReport::of_chain(error.chain(), message)
}

/// The `broker` command: parse the arguments, log to stderr, run, and turn
/// the outcome into the exit code: 0, 2 for usage errors, else the error
/// kind's (the README's "Errors"). The `broker` binary is this.
pub fn main() -> std::process::ExitCode {
    use broker_core::runtime::compiled;
    // Run by itself to compile a component apart (runtime::compiled): no CLI.
    if std::env::args_os().nth(1).is_some_and(|arg| arg == compiled::COMPILE_ARG) {
        return compiled::compiler_child_main();
    }
    // clap exits with 2 on usage errors and 0 for --help/--version.
    let cli = Cli::parse_args();
    // This very binary, even if the file was replaced since it started.
    let limits = compiled::CompileLimits { memory_bytes: cli.compile_memory_mib << 20, timeout: cli.compile_timeout };
    compiled::compile_in_children("/proc/self/exe".into(), limits);
    let default_level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        // Colours for a person at a terminal; a log file or a supervisor's journal gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .fmt_fields(broker_capabilities::error_text::EscapedFields)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let json = wants_json(&cli.command);
    let e = match runtime.block_on(run(cli)) {
        Ok(code) => return std::process::ExitCode::from(code),
        Err(e) => e,
    };
    let report = error_report(&e);
    if json {
        // JSON escapes what a provider said; a program reads this, not a terminal.
        println!("{}", output::json_line(&serde_json::json!({ "error": report })).unwrap_or_default());
    }
    // Errors quote what providers said: escaped, they cannot drive the terminal.
    let shown = broker_capabilities::error_text::escape_unprintable(&report.message);
    if e.downcast_ref::<UsageError>().is_some() {
        eprintln!("error: {shown}\n(see `broker --help`)");
        return std::process::ExitCode::from(2);
    }
    eprintln!("error: {shown}");
    std::process::ExitCode::from(report.kind.exit_code())
}
