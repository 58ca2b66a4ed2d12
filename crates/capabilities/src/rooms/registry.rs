//! The guest-facing capabilities, registered: one entry each in [`ROOMS`].
//! The linker, the import check at load, the conformance kit's "ungranted"
//! finding, the manifest's `[grants]`, `provider show` and the stores' data
//! all read this list.
//!
//! Each capability with a grant is a room ([`Room`]): its grant (its keys
//! under `[grants]`, parsed, compared with what an operator approved,
//! reported and shown), what it prepares when a version loads, its backend
//! (what its calls reach; the host's unless injected), its part of a store
//! and its `add_to_linker` are all in its own folder, and it joins the host
//! with one line here. The call context, which needs no grant, is a [`NoGrant`] entry.
//!
//! Rooms link against any store type that holds their parts ([`HasRooms`],
//! as wasmtime-wasi's `WasiView`): nothing here names the host's store.

use crate::rooms::denials::Denials;
use crate::rooms::kit::KitPart;
use crate::rooms::{context, http_egress, kv, local_socket, log, machine_lock, network_bridge, process};
use serde::de::{DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use wasmtime::component::{Linker, ResourceTable};
use wasmtime_wasi_http::WasiHttpView;

/// An error a room's preparation or backend gives, its cause kept.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A store's data that holds the rooms' parts: what every room links against.
/// `wasi:http` is a room too, so the store is a `WasiHttpView`; its impl
/// lends [`http_egress::http_view`] the room's part.
pub trait HasRooms: WasiHttpView + Send + 'static {
    /// The rooms' parts of this store, and its resource table.
    fn rooms(&mut self) -> (&mut Parts, &mut ResourceTable);

    /// `R`'s part of this store and the resource table, for its view.
    fn room<R: Registered>(&mut self) -> (&mut R::Ctx, &mut ResourceTable)
    where
        Self: Sized,
    {
        let (parts, table) = self.rooms();
        (parts.of::<R>(), table)
    }
}

/// How a capability is linked into a provider's stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linking {
    /// For every provider: without the grant each call answers `access-denied`
    /// (and the refusal is noted), so a provider can say what it lacks.
    Always,
    /// Only when granted: a component that imports it ungranted is refused at load.
    WhenGranted,
}

/// A registered capability, as the host at large sees it.
pub trait Capability: Send + Sync {
    /// Its interface in the contract package (`local-socket`).
    fn interface(&self) -> &'static str;
    /// Its key under `[grants]`, as a manifest spells it (`local-sockets`).
    fn grant(&self) -> &'static str;
    /// Whether it is linked for every provider or only when granted.
    fn linking(&self) -> Linking;
    /// Whether `grants` grant it.
    fn granted(&self, grants: &Grants) -> bool;
    /// Its grant's hooks, when the grant is its own (a [`Room`]'s).
    fn section(&self) -> Option<&dyn Section> {
        None
    }
    /// Its part in the conformance kit, if it has one of its own.
    fn kit(&self) -> Option<&'static dyn KitPart> {
        None
    }

    /// Whether a provider with `grants` gets it in its linker.
    fn linked_for(&self, grants: &Grants) -> bool {
        self.linking() == Linking::Always || self.granted(grants)
    }
}

/// What the host knows of a provider version it is loading, for a room to prepare.
pub struct LoadSetup<'a> {
    /// The provider's name.
    pub provider: &'a str,
    /// The provider's data dir on the host (`/data` to the guest).
    pub data_dir: &'a Path,
    /// All its grants (a room may depend on another's: confined programs
    /// share the host's network when bridging is granted).
    pub grants: &'a Grants,
    /// How granted programs are confined.
    pub sandbox: &'a crate::sandbox::Sandbox,
    /// What the rooms' calls will reach.
    pub backends: &'a Backends,
    /// What its granted programs may take together among them.
    pub programs: crate::sandbox::ProgramLimits,
}

/// What the rooms made ready when a provider version loaded, by room.
#[derive(Clone, Default)]
pub struct PreparedParts(BTreeMap<TypeId, Arc<dyn Any + Send + Sync>>);

impl PreparedParts {
    /// What `R` prepared (its default when it prepared nothing).
    pub fn of<R: Room>(&self) -> R::Prepared {
        self.0.get(&TypeId::of::<R>()).and_then(|p| p.downcast_ref::<R::Prepared>()).cloned().unwrap_or_default()
    }
}

/// What the host knows of a store it is making, for a room's part of it.
pub struct StoreSetup<'a> {
    /// The provider's name.
    pub provider: &'a Arc<str>,
    /// The provider's data dir on the host (`/data` to the guest).
    pub data_dir: &'a Path,
    /// Where the room's refusals are noted.
    pub denials: &'a Denials,
    /// Whether any of the provider's grants lets it act outside the store
    /// (then what it writes to kv must be durable before that effect).
    pub acts_outside_the_store: bool,
    /// The user its programs run as when confined (`None`: the host's own).
    pub sandbox_user: Option<u32>,
    /// What each room made ready when the version loaded.
    pub prepared: &'a PreparedParts,
    /// Where the room counts what its bounds refused or cut.
    pub quotas: &'a Arc<crate::quotas::Quotas>,
    /// Hides the provider's secrets in text of its the host shows.
    pub redactor: &'a Arc<crate::secrets::Redactor>,
}

/// A capability in a room of its own: everything of it is in its folder.
pub trait Room: Send + Sync + Sized + 'static {
    /// Its interface in the contract package (`local-socket`).
    const INTERFACE: &'static str;
    /// Its key under `[grants]`.
    const GRANT: &'static str;
    /// Further keys its grant spreads over (then the grant is read from the
    /// table of all its keys; `process` and the paths, devices and
    /// environment its programs get).
    const MORE_KEYS: &'static [&'static str] = &[];
    /// Whether it is linked for every provider or only when granted.
    const LINKING: Linking;
    /// Whether its backend reaches outside the host process (programs,
    /// sockets, the network): then a sealed sandbox must inject one, and
    /// one it does not inject refuses. A room without (`log`) is never sealed off.
    const REACHES_OUT: bool = true;
    /// Its part in the conformance kit: what stands in for its backend in a
    /// scripted run and records the host's in a recorded one. A room that
    /// reaches out has one, or another room's part stands in for it too.
    const KIT: Option<&'static dyn KitPart> = None;
    /// Its grant as `[grants]` holds it; the default grants nothing.
    type Grant: GrantValue;
    /// What its calls reach: the host's, or in the kit a simulation or a recording.
    type Backend: ?Sized + Send + Sync + 'static;
    /// Its part of a store; the default (for a store made without it)
    /// refuses every call and reaches nothing.
    type Ctx: Default + Send + 'static;
    /// What it makes of its grant once, when a provider version loads
    /// ([`Room::prepare`]); each store's part finds it in [`StoreSetup::prepared`].
    type Prepared: Clone + Default + Send + Sync + 'static;

    /// What its calls reach on the host when nothing is injected; `None`
    /// for a backend only the host can give (the machine lock is one per
    /// host): then a store without one injected refuses.
    fn host_backend() -> Option<Arc<Self::Backend>>;
    /// Make ready what a grant needs before any store is made (programs
    /// looked up, their confinement set up); an error refuses the load.
    fn prepare(_grant: &Self::Grant, _load: &LoadSetup<'_>) -> Result<Self::Prepared, BoxError> {
        Ok(Self::Prepared::default())
    }
    /// Whether the grant grants anything; by default the grant's own say.
    fn granted(grant: &Self::Grant) -> bool {
        grant.granted()
    }
    /// What `now` grants beyond `approved`, as a manifest would say it.
    fn widening(now: &Self::Grant, approved: &Self::Grant) -> Option<String> {
        now.widening(approved, Self::GRANT)
    }
    /// Whether the grant lets a provider act outside the store (so what it
    /// writes to kv must be durable before the effect it describes).
    fn acts_outside_the_store(grant: &Self::Grant) -> bool {
        Self::granted(grant)
    }
    /// The grant as `provider show` prints it.
    fn shown(grant: &Self::Grant) -> String {
        grant.shown()
    }
    /// The grant as the API reports it, by key; by default its own value under
    /// its own key. A room that reports other keys must report them all for
    /// its default grant too (that is how a CLI knows them for its own).
    fn view(grant: &Self::Grant) -> Map<String, Value> {
        Map::from_iter([(Self::GRANT.to_owned(), serde_json::to_value(grant).unwrap_or(Value::Null))])
    }
    /// The lines `provider show` prints for the API's report of the grants:
    /// one for each of its keys the report has and this host can read.
    fn shown_view(view: &Map<String, Value>) -> Vec<GrantLine> {
        let grant = view.get(Self::GRANT).and_then(|v| Self::Grant::deserialize(v).ok());
        grant.map(|grant| vec![GrantLine::new(Self::GRANT, Self::GRANT, Self::shown(&grant))]).unwrap_or_default()
    }
    /// Its part of a store. With no backend (not granted, or a sandbox that
    /// gives it none) it must refuse every call, saying so, and note each
    /// refusal in `store.denials` like any other.
    fn ctx(grant: &Self::Grant, backend: Option<Arc<Self::Backend>>, store: &StoreSetup<'_>) -> Self::Ctx;
    /// Add its host functions to a provider's linker.
    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()>;
    /// A call is about to run in the store (`abort` is set when it is cancelled).
    fn begin_call(_ctx: &mut Self::Ctx, _abort: &Arc<AtomicBool>) {}
    /// The call ended: release what it left behind (its handles in `table`).
    fn end_call(_ctx: &mut Self::Ctx, _table: &mut ResourceTable) {}
}

/// One line of `provider show`'s grants: what it says of the reported `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantLine {
    pub(crate) key: &'static str,
    pub(crate) label: &'static str,
    pub(crate) text: String,
}

impl GrantLine {
    pub(crate) fn new(key: &'static str, label: &'static str, text: String) -> Self {
        GrantLine { key, label, text }
    }
}

/// What a room's grant says of itself; a room's defaults read it.
pub trait GrantValue:
    for<'de> Deserialize<'de> + Serialize + Clone + Default + PartialEq + fmt::Debug + Send + Sync
{
    /// Whether it grants anything at all.
    fn granted(&self) -> bool;
    /// What `self` grants beyond `approved`, under the room's `key`.
    fn widening(&self, approved: &Self, key: &str) -> Option<String>;
    /// As `provider show` prints it.
    fn shown(&self) -> String;
}

/// A flag (`local-sockets = true`).
impl GrantValue for bool {
    fn granted(&self) -> bool {
        *self
    }

    fn widening(&self, approved: &bool, key: &str) -> Option<String> {
        (*self && !approved).then(|| format!("{key} = true"))
    }

    fn shown(&self) -> String {
        if *self { "granted" } else { "denied" }.to_owned()
    }
}

/// A [`Room`] registered in [`ROOMS`].
pub(crate) struct Own<R>(PhantomData<fn() -> R>);

impl<R> Own<R> {
    pub(crate) const ROOM: Own<R> = Own(PhantomData);
}

/// A room's grant, its type erased.
pub trait AnyGrant: Any + fmt::Debug + Send + Sync {
    /// Itself, for a downcast to the room's grant type.
    fn as_any(&self) -> &dyn Any;
}

impl<T: Any + fmt::Debug + Send + Sync> AnyGrant for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A room's grant hooks, its types erased.
pub trait Section: Send + Sync {
    /// Its own key under `[grants]`.
    fn key(&self) -> &'static str;
    /// Every key its grant spreads over under `[grants]` (its own first).
    fn keys(&self) -> Vec<&'static str>;
    /// Its grant from the table of its keys that a manifest gives.
    fn parse(&self, keys: toml::Table) -> Result<Arc<dyn AnyGrant>, String>;
    /// `None` stands for the default grant (nothing).
    fn same(&self, a: Option<&dyn AnyGrant>, b: Option<&dyn AnyGrant>) -> bool;
    /// See [`Room::widening`].
    fn widening(&self, now: Option<&dyn AnyGrant>, approved: Option<&dyn AnyGrant>) -> Option<String>;
    /// See [`Room::acts_outside_the_store`].
    fn acts_outside_the_store(&self, grant: Option<&dyn AnyGrant>) -> bool;
    /// As the API reports it, by key.
    fn view(&self, grant: Option<&dyn AnyGrant>) -> Map<String, Value>;
    /// The lines `provider show` prints for the API's report (none: no key of this room's).
    fn shown(&self, view: &Map<String, Value>) -> Vec<GrantLine>;
    /// Its part of a store: backend only if granted (see [`Room::ctx`]).
    fn part(&self, grant: Option<&dyn AnyGrant>, backends: &Backends, store: &StoreSetup<'_>) -> Part;
    /// [`Room::prepare`], keyed by the room for [`PreparedParts`].
    fn prepare(
        &self,
        grant: Option<&dyn AnyGrant>,
        load: &LoadSetup<'_>,
    ) -> Result<(TypeId, Arc<dyn Any + Send + Sync>), BoxError>;
}

impl<R: Room> Own<R> {
    fn grant(grant: Option<&dyn AnyGrant>) -> R::Grant {
        grant.and_then(|g| g.as_any().downcast_ref::<R::Grant>()).cloned().unwrap_or_default()
    }
}

impl<R: Room> Capability for Own<R> {
    fn interface(&self) -> &'static str {
        R::INTERFACE
    }
    fn grant(&self) -> &'static str {
        R::GRANT
    }
    fn linking(&self) -> Linking {
        R::LINKING
    }
    fn granted(&self, grants: &Grants) -> bool {
        R::granted(&grants.rooms.of::<R>())
    }
    fn section(&self) -> Option<&dyn Section> {
        Some(self)
    }
    fn kit(&self) -> Option<&'static dyn KitPart> {
        R::KIT
    }
}

impl<R: Room> Section for Own<R> {
    fn key(&self) -> &'static str {
        R::GRANT
    }
    fn keys(&self) -> Vec<&'static str> {
        std::iter::once(R::GRANT).chain(R::MORE_KEYS.iter().copied()).collect()
    }
    fn parse(&self, mut keys: toml::Table) -> Result<Arc<dyn AnyGrant>, String> {
        // A grant under one key is that key's value; one spread over several is their table.
        let value = match R::MORE_KEYS.is_empty() {
            true => keys.remove(R::GRANT).unwrap_or_else(|| toml::Value::Table(toml::Table::new())),
            false => toml::Value::Table(keys),
        };
        R::Grant::deserialize(value).map(|g| Arc::new(g) as Arc<dyn AnyGrant>).map_err(|e| e.message().to_owned())
    }
    fn same(&self, a: Option<&dyn AnyGrant>, b: Option<&dyn AnyGrant>) -> bool {
        Self::grant(a) == Self::grant(b)
    }
    fn widening(&self, now: Option<&dyn AnyGrant>, approved: Option<&dyn AnyGrant>) -> Option<String> {
        R::widening(&Self::grant(now), &Self::grant(approved))
    }
    fn acts_outside_the_store(&self, grant: Option<&dyn AnyGrant>) -> bool {
        R::acts_outside_the_store(&Self::grant(grant))
    }
    fn view(&self, grant: Option<&dyn AnyGrant>) -> Map<String, Value> {
        R::view(&Self::grant(grant))
    }
    fn shown(&self, view: &Map<String, Value>) -> Vec<GrantLine> {
        R::shown_view(view)
    }
    fn part(&self, grant: Option<&dyn AnyGrant>, backends: &Backends, store: &StoreSetup<'_>) -> Part {
        // A room's part holds its backend only with its grant: nothing
        // ungranted is ever within a store's reach.
        let grant = Self::grant(grant);
        let backend = backends.of::<R>().filter(|_| R::granted(&grant));
        Part::new::<R>(R::ctx(&grant, backend, store))
    }
    fn prepare(
        &self,
        grant: Option<&dyn AnyGrant>,
        load: &LoadSetup<'_>,
    ) -> Result<(TypeId, Arc<dyn Any + Send + Sync>), BoxError> {
        let prepared = R::prepare(&Self::grant(grant), load)?;
        Ok((TypeId::of::<R>(), Arc::new(prepared)))
    }
}

/// A capability with no grant of its own, linked for every provider (the
/// call context: what the host lends a call, nothing the provider reaches).
pub(crate) struct NoGrant {
    pub(crate) interface: &'static str,
}

impl Capability for NoGrant {
    fn interface(&self) -> &'static str {
        self.interface
    }
    fn grant(&self) -> &'static str {
        ""
    }
    fn linking(&self) -> Linking {
        Linking::Always
    }
    fn granted(&self, _: &Grants) -> bool {
        true
    }
}

/// A room in [`registered!`]'s list, at its place there: where a store's
/// [`Parts`] keep its part, so a host call finds it by index, not by search.
pub trait Registered: Room {
    /// The room's place in the list (and in every store's parts).
    const AT: usize;
}

/// Each room's [`Registered::AT`], counted along the list.
macro_rules! number_rooms {
    ($at:expr;) => {};
    ($at:expr; $room:ty $(, $rest:ty)*) => {
        impl Registered for $room {
            const AT: usize = $at;
        }
        number_rooms!($at + 1; $($rest),*);
    };
}

/// The registered rooms, once: [`ROOMS`] for the host at large, and
/// [`add_to_linker`], generic over the store, for the linker.
macro_rules! registered {
    ($($room:ty),* $(,)?) => {
        number_rooms!(0; $($room),*);

        /// Each room's part that refuses every call, in the list's order.
        fn refusing_parts() -> Vec<Part> {
            vec![$(Part::new::<$room>(Default::default())),*]
        }

        /// Each room's part found at its place (a type check that panics if not).
        #[cfg(test)]
        fn find_every_part(parts: &mut Parts) {
            $(let _ = parts.of::<$room>();)*
        }

        /// Every capability this host provides, besides WASI (linked for all,
        /// nothing ambient in it) and `types` (no functions).
        pub static ROOMS: &[&dyn Capability] = &[&NoGrant { interface: context::INTERFACE }, $(&Own::<$room>::ROOM),*];

        /// Add to `linker` the call context and each room `grants` link.
        pub fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>, grants: &Grants) -> wasmtime::Result<()> {
            context::add_to_linker(linker, |state: &mut T| context::ContextView { table: state.rooms().1 })?;
            $(
                if Own::<$room>::ROOM.linked_for(grants) {
                    <$room as Room>::add_to_linker(linker)?;
                }
            )*
            Ok(())
        }

        /// The rooms that reach outside the host but that `backends` gives
        /// nothing to reach: what a sealed sandbox made of them would refuse.
        #[cfg(test)]
        pub(crate) fn unserved(backends: &Backends) -> Vec<&'static str> {
            let mut unserved = Vec::new();
            $(
                if <$room as Room>::REACHES_OUT && backends.of::<$room>().is_none() {
                    unserved.push(<$room as Room>::INTERFACE);
                }
            )*
            unserved
        }
    };
}

// In this order a widening is named and `provider show` lists the grants.
registered!(
    kv::Kv,
    process::Process,
    local_socket::LocalSocket,
    log::Log,
    machine_lock::MachineLockRoom,
    http_egress::HttpEgress,
    network_bridge::NetworkBridge,
);

/// The registered capability serving `interface`.
pub fn room(interface: &str) -> Option<&'static dyn Capability> {
    ROOMS.iter().copied().find(|room| room.interface() == interface)
}

/// The rooms whose grants are their own, in registration order.
pub fn sections() -> impl Iterator<Item = &'static dyn Section> {
    ROOMS.iter().filter_map(|room| room.section())
}

/// Host interfaces a provider may import. Nothing is granted by default.
/// Each capability's grant is parsed, compared and shown by its room
/// (this module); `[grants]` is the rooms' keys and nothing else.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grants {
    /// The rooms' grants, by room.
    pub rooms: RoomGrants,
}

impl Grants {
    /// What this grants that `approved` does not, if anything (each room's
    /// first new grant): what an operator must approve before it applies.
    pub fn widening(&self, approved: &Grants) -> Option<String> {
        self.rooms.widening(&approved.rooms)
    }
}

/// The rooms' own grants of one manifest, by key; a room absent here grants nothing.
#[derive(Clone, Default)]
pub struct RoomGrants(BTreeMap<&'static str, Arc<dyn AnyGrant>>);

impl RoomGrants {
    /// `R`'s grant (the default if the manifest has none).
    pub fn of<R: Room>(&self) -> R::Grant {
        Own::<R>::grant(self.get(R::GRANT))
    }

    /// Set `R`'s grant (for tests and tools that build grants in code).
    pub fn with<R: Room>(mut self, grant: R::Grant) -> Self {
        self.0.insert(R::GRANT, Arc::new(grant));
        self
    }

    fn get(&self, key: &str) -> Option<&dyn AnyGrant> {
        self.0.get(key).map(|g| &**g)
    }

    /// What these grant that `approved` does not: each room's first new
    /// grant, so an operator asked to approve one sees all that approval brings.
    pub fn widening(&self, approved: &RoomGrants) -> Option<String> {
        let wider: Vec<String> =
            sections().filter_map(|s| s.widening(self.get(s.key()), approved.get(s.key()))).collect();
        (!wider.is_empty()).then(|| wider.join(", "))
    }

    /// What each room makes ready for a provider version that loads; the
    /// first refusal (whose text says what it is about).
    pub fn prepare(&self, load: &LoadSetup<'_>) -> Result<PreparedParts, BoxError> {
        let mut prepared = PreparedParts::default();
        for section in sections() {
            let (room, part) = section.prepare(self.get(section.key()), load)?;
            prepared.0.insert(room, part);
        }
        Ok(prepared)
    }

    /// Whether any lets the provider act outside the store.
    pub fn act_outside_the_store(&self) -> bool {
        sections().any(|s| s.acts_outside_the_store(self.get(s.key())))
    }

    /// Every room's grant as the API reports it, by key.
    pub fn view(&self) -> BTreeMap<String, Value> {
        sections().flat_map(|s| s.view(self.get(s.key()))).collect()
    }
}

/// The API's report of the grants as `provider show` prints it (label,
/// text): each room's lines in registration order, then, as its JSON, any key
/// no room of this host could read (a newer daemon's room, or a shape this
/// host does not know): a grant is never left out.
pub fn shown(view: &BTreeMap<String, Value>) -> Vec<(String, String)> {
    let view: Map<String, Value> = view.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let lines: Vec<GrantLine> = sections().flat_map(|s| s.shown(&view)).collect();
    let read = |key: &String| lines.iter().any(|line| line.key == key);
    let unread: Vec<(String, String)> =
        view.iter().filter(|(key, _)| !read(key)).map(|(key, v)| (key.clone(), v.to_string())).collect();
    lines.into_iter().map(|line| (line.label.to_owned(), line.text)).chain(unread).collect()
}

impl PartialEq for RoomGrants {
    fn eq(&self, other: &Self) -> bool {
        sections().all(|s| s.same(self.get(s.key()), other.get(s.key())))
    }
}

impl Eq for RoomGrants {}

impl fmt::Debug for RoomGrants {
    /// Every room's grant, as equal grants compare: a key left out and its default look alike.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.view()).finish()
    }
}

/// Parse `[grants]`: each key by the room it belongs to (unknown keys
/// refused). Errors keep the line of the key or value they are about.
pub fn deserialize_grants<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Grants, D::Error> {
    struct Table;
    impl<'de> Visitor<'de> for Table {
        type Value = Grants;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a table of grants")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Grants, A::Error> {
            // Each room's keys as met (a room's grant may spread over several).
            let mut tables: BTreeMap<&'static str, (&'static dyn Section, toml::Table)> = BTreeMap::new();
            while let Some((room, key)) = map.next_key_seed(KeySeed)? {
                // TOML refuses a key given twice before this sees it.
                let value = map.next_value_seed(ValueSeed(room, key))?;
                tables.entry(room.key()).or_insert_with(|| (room, toml::Table::new())).1.insert(key.to_owned(), value);
            }
            let mut rooms = RoomGrants::default();
            for (key, (room, table)) in tables {
                let grant = room.parse(table).map_err(serde::de::Error::custom)?;
                rooms.0.insert(key, grant);
            }
            Ok(Grants { rooms })
        }
    }
    deserializer.deserialize_map(Table)
}

/// A key under `[grants]`, with the room it belongs to.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = (&'static dyn Section, &'static str);
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        let key = String::deserialize(deserializer)?;
        let found = sections().find_map(|s| s.keys().iter().find(|k| **k == key).map(|k| (s, *k)));
        found.ok_or_else(|| {
            let known: Vec<String> = sections().flat_map(|s| s.keys()).map(|k| format!("`{k}`")).collect();
            serde::de::Error::custom(format!("unknown field `{key}`, expected one of {}", known.join(", ")))
        })
    }
}

/// One key's value, checked by its room alone (so an error has its line).
struct ValueSeed(&'static dyn Section, &'static str);

impl<'de> DeserializeSeed<'de> for ValueSeed {
    type Value = toml::Value;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        let value = toml::Value::deserialize(deserializer)?;
        let alone = toml::Table::from_iter([(self.1.to_owned(), value.clone())]);
        self.0.parse(alone).map_err(serde::de::Error::custom)?;
        Ok(value)
    }
}

/// The backends of the rooms, by room: the host's unless one was injected.
#[derive(Clone, Default)]
pub struct Backends {
    injected: BTreeMap<TypeId, Arc<dyn Any + Send + Sync>>,
    sealed: bool,
}

impl Backends {
    /// Only what is injected: a room given no backend refuses every call
    /// rather than reach the host's (the conformance kit's sandbox).
    pub fn sealed() -> Self {
        Backends { injected: BTreeMap::new(), sealed: true }
    }

    /// `R`'s calls reach `backend` (the kit's simulation or recording).
    pub fn with<R: Room>(mut self, backend: Arc<R::Backend>) -> Self {
        self.injected.insert(TypeId::of::<R>(), Arc::new(backend));
        self
    }

    /// What `R`'s calls reach (`None`: nothing, in a sealed set or for a
    /// backend only the host gives). Grants are not checked here: a store's
    /// part gets its backend only with its grant ([`Parts::new`]).
    pub fn of<R: Room>(&self) -> Option<Arc<R::Backend>> {
        let injected = self.injected.get(&TypeId::of::<R>()).and_then(|b| b.downcast_ref::<Arc<R::Backend>>());
        match injected {
            Some(backend) => Some(backend.clone()),
            None if self.sealed && R::REACHES_OUT => None,
            None => R::host_backend(),
        }
    }
}

/// One room's part of a store, with its room's call hooks.
pub struct Part {
    ctx: Box<dyn Any + Send>,
    begin_call: fn(&mut (dyn Any + Send), &Arc<AtomicBool>),
    end_call: fn(&mut (dyn Any + Send), &mut ResourceTable),
}

impl Part {
    fn new<R: Room>(ctx: R::Ctx) -> Part {
        Part {
            ctx: Box::new(ctx),
            begin_call: |ctx, abort| {
                if let Some(ctx) = ctx.downcast_mut::<R::Ctx>() {
                    R::begin_call(ctx, abort);
                }
            },
            end_call: |ctx, table| {
                if let Some(ctx) = ctx.downcast_mut::<R::Ctx>() {
                    R::end_call(ctx, table);
                }
            },
        }
    }
}

/// The rooms' parts of one store, each at its room's [`Registered::AT`].
pub struct Parts(Vec<Part>);

impl Default for Parts {
    /// Every room's part refusing every call.
    fn default() -> Self {
        Parts(refusing_parts())
    }
}

impl Parts {
    /// Each room's part of a new store, its grant from `grants`
    /// (`sections()` is the registered list, in its order).
    pub fn new(grants: &RoomGrants, backends: &Backends, store: &StoreSetup<'_>) -> Self {
        Parts(sections().map(|s| s.part(grants.get(s.key()), backends, store)).collect())
    }

    /// `R`'s part: at its place, one type check (every store has every
    /// registered room's part, [`Parts::new`] and `default` alike).
    pub fn of<R: Registered>(&mut self) -> &mut R::Ctx {
        self.0
            .get_mut(R::AT)
            .and_then(|part| part.ctx.downcast_mut::<R::Ctx>())
            .expect("a store's parts are the registered rooms, in their order")
    }

    /// Each room's [`Room::begin_call`].
    pub fn begin_call(&mut self, abort: &Arc<AtomicBool>) {
        for part in &mut self.0 {
            (part.begin_call)(&mut *part.ctx, abort);
        }
    }

    /// Each room's [`Room::end_call`].
    pub fn end_call(&mut self, table: &mut ResourceTable) {
        for part in &mut self.0 {
            (part.end_call)(&mut *part.ctx, table);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_interface_is_registered_once_and_only_some_are_linked_without_a_grant() {
        let mut interfaces: Vec<&str> = ROOMS.iter().map(|r| r.interface()).collect();
        interfaces.sort();
        interfaces.dedup();
        assert_eq!(interfaces.len(), ROOMS.len(), "an interface registered twice");
        let mut keys: Vec<&str> = ROOMS.iter().map(|r| r.grant()).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), ROOMS.len(), "a grant key registered twice");
        let none = Grants::default();
        let linked: Vec<&str> = ROOMS.iter().filter(|r| r.linked_for(&none)).map(|r| r.interface()).collect();
        assert_eq!(linked, ["context", "process", "local-socket", "machine-lock", "wasi:http", "network-bridge"]);
        let logging = RoomGrants::default().with::<log::Log>(true);
        let linked: Vec<&str> =
            ROOMS.iter().filter(|r| r.linked_for(&Grants { rooms: logging.clone() })).map(|r| r.interface()).collect();
        assert_eq!(
            linked,
            ["context", "process", "local-socket", "log", "machine-lock", "wasi:http", "network-bridge"]
        );
    }

    /// No two rooms claim one key under `[grants]` (the second would never
    /// see its grant, nor check its widening), nor report one key in the API's
    /// view of the grants; every room reports something for its default grant.
    #[test]
    fn no_two_rooms_share_a_key_in_grants_or_in_their_view() {
        let mut keys: Vec<&str> = sections().flat_map(|s| s.keys()).collect();
        let all = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), all, "a [grants] key claimed twice: {keys:?}");
        let mut reported: Vec<String> = Vec::new();
        for section in sections() {
            let view = section.view(None);
            assert!(!view.is_empty(), "{} reports nothing", section.key());
            reported.extend(view.into_iter().map(|(key, _)| key));
        }
        let all = reported.len();
        reported.sort();
        reported.dedup();
        assert_eq!(reported.len(), all, "a view key reported twice: {reported:?}");
    }

    /// A store always has every room's part: one made without it gets one
    /// that refuses, never a panic.
    #[tokio::test]
    async fn every_room_has_its_part_in_a_store() {
        let mut parts = Parts::default();
        find_every_part(&mut parts);
        let ctx = parts.of::<local_socket::LocalSocket>();
        assert!(!ctx.granted());
        let provider: Arc<str> = "p".into();
        let store = StoreSetup {
            provider: &provider,
            data_dir: Path::new("/nonexistent"),
            denials: &Denials::default(),
            acts_outside_the_store: false,
            sandbox_user: None,
            prepared: &PreparedParts::default(),
            quotas: &Default::default(),
            redactor: &Default::default(),
        };
        let grants = RoomGrants::default().with::<local_socket::LocalSocket>(true);
        let mut parts = Parts::new(&grants, &Backends::default(), &store);
        assert!(parts.of::<local_socket::LocalSocket>().granted());
        assert_eq!(parts.0.len(), sections().count());
        find_every_part(&mut parts);
        // The kit's sealed backends: a room it gave none refuses, granted or not, saying why.
        let mut parts = Parts::new(&grants, &Backends::sealed(), &store);
        let sealed = parts.of::<local_socket::LocalSocket>();
        assert!(!sealed.granted());
        let refused = sealed.connect("/data/vm.qmp").await.err();
        assert!(matches!(refused, Some(local_socket::SocketError::NoBackend)), "{refused:?}");
        // A room that reaches nothing outside is not sealed off.
        assert!(Backends::sealed().of::<log::Log>().is_some());
        // The machine lock is the host's to give: granted but not given, it refuses, sealed or not.
        let locking = RoomGrants::default().with::<machine_lock::MachineLockRoom>(true);
        for backends in [Backends::default(), Backends::sealed()] {
            assert!(!Parts::new(&locking, &backends, &store).of::<machine_lock::MachineLockRoom>().granted());
        }
        let dir = tempfile::tempdir().unwrap();
        let lock = machine_lock::MachineLock::new(dir.path(), "machine-lock", "test").unwrap();
        let given = Backends::sealed().with::<machine_lock::MachineLockRoom>(Arc::new(lock));
        assert!(Parts::new(&locking, &given, &store).of::<machine_lock::MachineLockRoom>().granted());
        assert!(
            !Parts::new(&grants, &given, &store).of::<machine_lock::MachineLockRoom>().granted(),
            "given, not granted"
        );
        let injected = Backends::sealed().with::<local_socket::LocalSocket>(Arc::new(local_socket::HostSockets));
        assert!(Parts::new(&grants, &injected, &store).of::<local_socket::LocalSocket>().granted());
    }
}
