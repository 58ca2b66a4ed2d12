//! A component's `instance-broker`, of whichever published contract version
//! it exports: the host calls them alike. The versions share every type (see
//! `bindings::v0_2`, `bindings::v0_1`) but `all-instances`, which 0.3.0
//! pages: an older component's one answer is paged by the host.
//!
//! Each export is found and type-checked once per component, when it loads
//! (a component whose exports do not have the contract's types is refused
//! then, the export named), and typed in an instance only when the instance
//! first calls it: an instance made for one call (per-call isolation) types
//! one function, not the six that the generated `load` checks at every
//! instantiation.

use crate::runtime::HostState;
use broker_capabilities::bindings::{
    self, BrokerError, Instance, InstanceId, InstancePage, ListedInstance, PageRequest, ProviderInfo,
    StartInstanceParams, StartInstanceResult,
};
use broker_capabilities::rooms::context::CallContext;
use std::sync::OnceLock;
use wasmtime::Store;
use wasmtime::component::types::{ComponentFunc, ComponentItem};
use wasmtime::component::{ComponentExportIndex, ComponentNamedList, Instance as GuestInstance, InstancePre};
use wasmtime::component::{Lift, Lower, Resource, TypedFunc};

/// The exports of one function each, in the component.
#[derive(Clone, Copy)]
struct Indices {
    describe: ComponentExportIndex,
    validate_config: ComponentExportIndex,
    start_instance: ComponentExportIndex,
    stop_instances: ComponentExportIndex,
    all_instances: ComponentExportIndex,
    maintain_instance: ComponentExportIndex,
}

/// Ready to instantiate, for the version [`super::imports::check`] found.
pub(crate) struct ExportsPre {
    pre: InstancePre<HostState>,
    at: Indices,
    /// Its `all-instances` answers a page at a time (0.3.0 on).
    paged: bool,
}

type Ctx = Resource<CallContext>;
type Refusable<T> = Result<T, BrokerError>;

// Each export's signature as the host calls it, spelled once: checked against
// the component at load ([`Signature`]) and typed with it in an instance.
type Describe = TypedFunc<(), (ProviderInfo,)>;
type ValidateConfig = TypedFunc<(String,), (Refusable<()>,)>;
type StartInstance = TypedFunc<(Ctx, StartInstanceParams), (Refusable<StartInstanceResult>,)>;
type StopInstances = TypedFunc<(Ctx, Vec<InstanceId>), (Refusable<()>,)>;
type AllInstancesPaged = TypedFunc<(Ctx, PageRequest), (Refusable<InstancePage>,)>;
type AllInstancesWhole = TypedFunc<(Ctx,), (Refusable<Vec<Instance>>,)>;
type MaintainInstance = TypedFunc<(Ctx, InstanceId, StartInstanceParams), (Refusable<()>,)>;

/// One instance's exports, each typed when first called.
pub(crate) struct Exports {
    instance: GuestInstance,
    at: Indices,
    paged: bool,
    describe: OnceLock<Describe>,
    validate_config: OnceLock<ValidateConfig>,
    start_instance: OnceLock<StartInstance>,
    stop_instances: OnceLock<StopInstances>,
    all_instances_paged: OnceLock<AllInstancesPaged>,
    all_instances_whole: OnceLock<AllInstancesWhole>,
    maintain_instance: OnceLock<MaintainInstance>,
}

/// An export's Rust signature, which a component's function must have.
trait Signature {
    /// Whether `func` of the component in `pre` has it.
    fn typecheck(func: &ComponentFunc, pre: &InstancePre<HostState>) -> wasmtime::Result<()>;
}

impl<P, R> Signature for TypedFunc<P, R>
where
    P: ComponentNamedList + Lower,
    R: ComponentNamedList + Lift,
{
    fn typecheck(func: &ComponentFunc, pre: &InstancePre<HostState>) -> wasmtime::Result<()> {
        // The check the generated bindings make (doc-hidden in wasmtime, which is pinned).
        func.typecheck::<P, R>(&pre.instance_type())
    }
}

impl ExportsPre {
    /// The exports of `version` (one of `bindings::SERVED_VERSIONS`) in `pre`,
    /// every one type-checked against that version's contract.
    pub(crate) fn new(version: &str, pre: InstancePre<HostState>) -> wasmtime::Result<ExportsPre> {
        let interface = format!("{}/instance-broker@{version}", bindings::CONTRACT_PACKAGE);
        let (_, broker) = pre
            .component()
            .get_export(None, &interface)
            .ok_or_else(|| wasmtime::format_err!("no export `{interface}` found"))?;
        let paged = !matches!(version, "0.1.0" | "0.2.0");
        let export = BrokerExport { pre: &pre, interface: &interface, broker: &broker };
        let at = Indices {
            describe: export.checked::<Describe>("describe")?,
            validate_config: export.checked::<ValidateConfig>("validate-config")?,
            start_instance: export.checked::<StartInstance>("start-instance")?,
            stop_instances: export.checked::<StopInstances>("stop-instances")?,
            all_instances: if paged {
                export.checked::<AllInstancesPaged>("all-instances")?
            } else {
                export.checked::<AllInstancesWhole>("all-instances")?
            },
            maintain_instance: export.checked::<MaintainInstance>("maintain-instance")?,
        };
        Ok(ExportsPre { pre, at, paged })
    }

    /// Whether its `all-instances` answers a page at a time.
    pub(crate) fn paged(&self) -> bool {
        self.paged
    }

    pub(crate) async fn instantiate_async(&self, store: &mut Store<HostState>) -> wasmtime::Result<Exports> {
        let instance = self.pre.instantiate_async(&mut *store).await?;
        Ok(Exports {
            instance,
            at: self.at,
            paged: self.paged,
            describe: OnceLock::new(),
            validate_config: OnceLock::new(),
            start_instance: OnceLock::new(),
            stop_instances: OnceLock::new(),
            all_instances_paged: OnceLock::new(),
            all_instances_whole: OnceLock::new(),
            maintain_instance: OnceLock::new(),
        })
    }
}

/// One component's `instance-broker` export, while its functions are looked up.
struct BrokerExport<'a> {
    pre: &'a InstancePre<HostState>,
    interface: &'a str,
    broker: &'a ComponentExportIndex,
}

impl BrokerExport<'_> {
    /// The function `name`, checked to have the signature `F` (the one
    /// [`Exports`] calls it with).
    fn checked<F: Signature>(&self, name: &str) -> wasmtime::Result<ComponentExportIndex> {
        let interface = self.interface;
        let (item, index) = (self.pre.component().get_export(Some(self.broker), name))
            .ok_or_else(|| wasmtime::format_err!("export `{interface}` has no function `{name}`"))?;
        let ComponentItem::ComponentFunc(func) = item else {
            return Err(wasmtime::format_err!("`{name}` of export `{interface}` is not a function"));
        };
        F::typecheck(&func, self.pre)
            .map_err(|e| e.context(format!("`{name}` of export `{interface}` does not have the contract's type")))?;
        Ok(index)
    }
}

/// What `all-instances` answered, as the host reads it.
pub(crate) enum Listing {
    /// One page of a paging provider (0.3.0 on).
    Page(InstancePage),
    /// Every instance at once (0.2.0 and before), as listed instances.
    Whole(Vec<ListedInstance>),
}

/// A borrow of the call's context, for one export call.
fn lend(ctx: &Ctx) -> Ctx {
    Resource::new_borrow(ctx.rep())
}

impl Exports {
    /// Call the export at `index` with `params`: typed the first time (kept
    /// in `typed`), as it is from then on.
    async fn call<P, R>(
        &self,
        store: &mut Store<HostState>,
        index: &ComponentExportIndex,
        typed: &OnceLock<TypedFunc<P, (R,)>>,
        params: P,
    ) -> wasmtime::Result<R>
    where
        P: ComponentNamedList + Lower + Send + Sync,
        R: Lift + Send + Sync + 'static,
    {
        let func = match typed.get() {
            Some(func) => *func,
            None => {
                let func = self.instance.get_typed_func::<P, (R,)>(&mut *store, index)?;
                *typed.get_or_init(|| func)
            }
        };
        Ok(func.call_async(&mut *store, params).await?.0)
    }

    /// `describe`: who the provider is.
    pub(crate) async fn describe(&self, store: &mut Store<HostState>) -> wasmtime::Result<ProviderInfo> {
        self.call(store, &self.at.describe, &self.describe, ()).await
    }

    /// `validate-config` of `config` (JSON).
    pub(crate) async fn validate_config(
        &self,
        store: &mut Store<HostState>,
        config: String,
    ) -> wasmtime::Result<Refusable<()>> {
        self.call(store, &self.at.validate_config, &self.validate_config, (config,)).await
    }

    /// `start-instance` with `params`.
    pub(crate) async fn start_instance(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        params: StartInstanceParams,
    ) -> wasmtime::Result<Refusable<StartInstanceResult>> {
        self.call(store, &self.at.start_instance, &self.start_instance, (lend(ctx), params)).await
    }

    /// `stop-instances` of `ids`.
    pub(crate) async fn stop_instances(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        ids: Vec<InstanceId>,
    ) -> wasmtime::Result<Refusable<()>> {
        self.call(store, &self.at.stop_instances, &self.stop_instances, (lend(ctx), ids)).await
    }

    /// `maintain-instance` of `id`, started with `params`.
    pub(crate) async fn maintain_instance(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        id: InstanceId,
        params: StartInstanceParams,
    ) -> wasmtime::Result<Refusable<()>> {
        self.call(store, &self.at.maintain_instance, &self.maintain_instance, (lend(ctx), id, params)).await
    }

    /// `all-instances` of whichever version: a page of the current one (asked
    /// with `page`), or an older one's whole answer (`page` unused).
    pub(crate) async fn all_instances(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        page: &PageRequest,
    ) -> wasmtime::Result<Refusable<Listing>> {
        let (index, ctx) = (&self.at.all_instances, lend(ctx));
        Ok(if self.paged {
            self.call(store, index, &self.all_instances_paged, (ctx, page.clone())).await?.map(Listing::Page)
        } else {
            self.call(store, index, &self.all_instances_whole, (ctx,)).await?.map(whole)
        })
    }
}

/// An older version's answer: instances with nothing more known of them.
fn whole(instances: Vec<Instance>) -> Listing {
    let listed = |instance| ListedInstance { instance, display_name: String::new(), hardware: None, tags: Vec::new() };
    Listing::Whole(instances.into_iter().map(listed).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;
    use crate::manifest::Grants;
    use broker_capabilities::rooms::RoomGrants;
    use broker_capabilities::rooms::kv::Kv;
    use std::path::Path;

    fn pre_of(runtime: &crate::runtime::Runtime, guest: &str) -> InstancePre<HostState> {
        let path = guest_artifacts::wasm(guest);
        let bytes = std::fs::read(&path).unwrap();
        let component = runtime.compile(Path::new(&path), &bytes, "").unwrap();
        let grants = Grants { rooms: RoomGrants::default().with::<Kv>(true) };
        runtime.linker(&grants).unwrap().instantiate_pre(&component).unwrap()
    }

    /// Each export is type-checked when the component loads: the types the
    /// host calls it with pass, others are refused with the export named,
    /// and a version's exports are looked for under its own name.
    #[test]
    fn exports_are_type_checked_at_load_and_a_mismatch_is_named() {
        let runtime = crate::runtime::Runtime::new(None).unwrap();
        let current = pre_of(&runtime, "fake");
        assert!(ExportsPre::new(bindings::CONTRACT_VERSION, current.clone()).unwrap().paged());
        let interface = format!("{}/instance-broker@{}", bindings::CONTRACT_PACKAGE, bindings::CONTRACT_VERSION);
        let (_, broker) = current.component().get_export(None, &interface).unwrap();
        let export = BrokerExport { pre: &current, interface: &interface, broker: &broker };
        assert!(export.checked::<Describe>("describe").is_ok());
        let mistyped = export.checked::<ValidateConfig>("describe").unwrap_err();
        assert!(
            format!("{mistyped:#}").contains(
                "`describe` of export `broker:provider/instance-broker@0.3.0` does not have the contract's type"
            ),
            "{mistyped:#}"
        );
        // The paged signature is not 0.2.0's whole answer, nor the reverse.
        assert!(export.checked::<AllInstancesPaged>("all-instances").is_ok());
        assert!(export.checked::<AllInstancesWhole>("all-instances").is_err());
        assert!(export.checked::<Describe>("teleport").unwrap_err().to_string().contains("no function `teleport`"));
        let unexported = ExportsPre::new("0.2.0", current).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(unexported.contains("no export `broker:provider/instance-broker@0.2.0`"), "{unexported}");

        let older = pre_of(&runtime, "fake_v0_2");
        assert!(!ExportsPre::new("0.2.0", older.clone()).unwrap().paged());
        let interface = format!("{}/instance-broker@0.2.0", bindings::CONTRACT_PACKAGE);
        let (_, broker) = older.component().get_export(None, &interface).unwrap();
        let export = BrokerExport { pre: &older, interface: &interface, broker: &broker };
        assert!(export.checked::<AllInstancesWhole>("all-instances").is_ok());
        assert!(export.checked::<AllInstancesPaged>("all-instances").is_err());
    }
}
