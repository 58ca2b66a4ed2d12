//! The data of one guest store.

use super::GuestLimiter;
use broker_capabilities::network::backend::NetworkBackend;
use broker_capabilities::rooms::denials::Denials;
use broker_capabilities::rooms::kv::{Kv, KvBackend};
use broker_capabilities::rooms::network_bridge::NetworkBridge;
use broker_capabilities::rooms::process::{ChildRecords, HostProcesses, Process};
use broker_capabilities::rooms::wasi;
use broker_capabilities::rooms::{Backends, HasRooms, Parts, PreparedParts, RoomGrants, StoreSetup};
use std::path::PathBuf;
use std::sync::Arc;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtxView, WasiHttpView};

/// What a guest store holds: the provider's name, its resources, WASI and
/// each capability's part, as far as the manifest grants them.
pub struct HostState {
    /// The provider's name.
    pub provider: Arc<str>,
    pub(crate) table: ResourceTable,
    pub(crate) wasi: WasiCtx,
    /// What the guest last wrote to stderr in its current call.
    pub(crate) stderr_tail: wasi::StderrTail,
    /// The parts of the capabilities in rooms of their own.
    pub(crate) rooms: Parts,
    pub(crate) limiter: GuestLimiter,
    /// Its guest's turn of executor time, once it runs long.
    pub(crate) turn: super::turnstile::StoreTurn,
    /// Where refusals outside any one capability (the filesystem's) are noted.
    denials: Denials,
}

/// The host facilities a provider's stores draw on; each is handed to a
/// store only as far as the manifest grants it.
#[derive(Clone)]
pub struct HostCapabilities {
    /// Each provider gets `<data_dirs>/<name>` as its data dir (`/data` to the guest).
    /// Never inside a directory manifests or components are loaded from.
    pub data_dirs: PathBuf,
    /// How granted programs are confined (bubblewrap, the sandbox users).
    pub sandbox: broker_capabilities::sandbox::Sandbox,
    /// What the capabilities' calls reach: the host's, unless the kit
    /// injected a simulation or a recording.
    pub backends: Backends,
    /// Where refused host calls are noted besides the log (the conformance kit collects them).
    pub denials: Denials,
    /// Mounts each provider's data dir as a filesystem of its own
    /// (`data-mib`); `None`: data dirs are plain directories (tests, the kit).
    pub data_filesystems: Option<Arc<broker_capabilities::data_fs::DataFilesystems>>,
    /// Where the secrets manifests name under `[secrets]` are read (none:
    /// such a manifest does not load).
    pub secrets: broker_capabilities::secrets::SecretSource,
}

impl HostCapabilities {
    /// The host's own backends: the store's kv, real programs (their children
    /// recorded in `child_records`), sockets, egress targets and network; no
    /// machine lock and no denials collected until given.
    pub fn on_host(
        kv: Arc<dyn KvBackend>,
        data_dirs: PathBuf,
        sandbox: broker_capabilities::sandbox::Sandbox,
        child_records: Arc<dyn ChildRecords>,
    ) -> Self {
        HostCapabilities {
            data_dirs,
            sandbox,
            backends: Backends::default()
                .with::<Kv>(kv)
                .with::<Process>(Arc::new(HostProcesses::new(child_records, Arc::default()))),
            denials: Denials::default(),
            data_filesystems: None,
            secrets: broker_capabilities::secrets::SecretSource::None,
        }
    }

    /// The store's kv, where a call's changes are made durable (`None`: a
    /// sandbox that gives none).
    pub fn kv(&self) -> Option<Arc<dyn KvBackend>> {
        self.backends.of::<Kv>()
    }

    /// The network HostPreparer and the bridge capability act on: the
    /// host's kernel, or the kit's simulation (`None`: a sandbox that gives none).
    pub fn network(&self) -> Option<Arc<dyn NetworkBackend>> {
        self.backends.of::<NetworkBridge>()
    }
}

/// What one provider's stores get: the host capabilities narrowed to its grants.
#[derive(Clone)]
pub(crate) struct ProviderCapabilities {
    pub(crate) host: HostCapabilities,
    pub(crate) data_dir: PathBuf,
    /// The grants of the capabilities in rooms.
    pub rooms: RoomGrants,
    /// What the rooms made ready when the version loaded (confined programs).
    pub prepared: PreparedParts,
    /// What its bounds refused or cut, counted (the version's metrics).
    pub quotas: Arc<broker_capabilities::quotas::Quotas>,
    /// Hides its secrets' values in the text of its the host shows (log lines, output).
    pub redactor: Arc<broker_capabilities::secrets::Redactor>,
}

impl ProviderCapabilities {
    /// Whether a grant lets the provider act outside the store (programs,
    /// sockets, bridges, outgoing HTTP): then what it writes to kv must be
    /// durable before the effect it describes happens, and is made durable
    /// per change rather than at the call's end.
    pub(crate) fn acts_outside_the_store(&self) -> bool {
        self.rooms.act_outside_the_store()
    }
}

/// Most entries in one store's resource table.
const MAX_HANDLES: usize = 4096;

impl HostState {
    pub(crate) fn new(
        provider: Arc<str>,
        caps: &ProviderCapabilities,
        memory_bytes: usize,
        turn: super::turnstile::StoreTurn,
    ) -> Self {
        let host = &caps.host;
        let denials = host.denials.for_provider(provider.clone(), caps.quotas.clone()).redacting(caps.redactor.clone());
        // Taps a provider makes go to the user its programs run as.
        let sandbox_user = caps.prepared.of::<Process>().and_then(|p| p.confinement().map(|c| c.uid()));
        // Handles a guest can make the host keep (streams, descriptors, its
        // own resources) in one store: bounded, as its memory is.
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_HANDLES);
        let stderr_tail = wasi::StderrTail::new(caps.redactor.clone());
        HostState {
            table,
            wasi: wasi::sandboxed_ctx(&provider, &caps.data_dir, &caps.quotas, &caps.redactor, &stderr_tail),
            stderr_tail,
            rooms: Parts::new(
                &caps.rooms,
                &host.backends,
                &StoreSetup {
                    provider: &provider,
                    data_dir: &caps.data_dir,
                    denials: &denials,
                    acts_outside_the_store: caps.acts_outside_the_store(),
                    sandbox_user,
                    prepared: &caps.prepared,
                    quotas: &caps.quotas,
                    redactor: &caps.redactor,
                },
            ),
            limiter: GuestLimiter::new(memory_bytes),
            turn,
            denials,
            provider,
        }
    }

    /// A guest's `symlink-at` was refused: noted like any refused host call.
    pub(crate) fn symlink_refused(&mut self, path: &str) {
        // The path is the guest's: shown escaped and cut short.
        let shown: String = path.chars().take(64).collect();
        let message = format!("symlink-at {shown:?} refused: providers may not make symbolic links in /data");
        self.denials.note("filesystem", &message);
    }

    /// A call is about to run in this store (`abort` is its cancellation).
    pub fn begin_call(&mut self, abort: &Arc<std::sync::atomic::AtomicBool>) {
        self.stderr_tail.clear();
        self.rooms.begin_call(abort);
    }

    /// Release what a call left behind (machine-lock guards, its turn);
    /// whether it gave back a turn of executor time.
    pub fn end_call(&mut self) -> bool {
        self.rooms.end_call(&mut self.table);
        self.turn.release()
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl HasRooms for HostState {
    fn rooms(&mut self) -> (&mut Parts, &mut ResourceTable) {
        (&mut self.rooms, &mut self.table)
    }
}

impl WasiHttpView for HostState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        broker_capabilities::rooms::http_egress::http_view(self)
    }
}
