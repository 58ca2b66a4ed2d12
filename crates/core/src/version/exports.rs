//! A component's `instance-broker`, of whichever published contract version
//! it exports: the host calls them alike. The versions share every type (see
//! `bindings::v0_2`, `bindings::v0_1`) but `all-instances`, which 0.3.0
//! pages: an older component's one answer is paged by the host.
//!
//! Each export is found once per component (and its whole interface
//! type-checked then, by the version's generated `ProviderPre`), and checked
//! against its Rust signature in an instance only when the instance first
//! calls it: an instance made for one call (per-call isolation) checks one
//! function, not the six that the generated `load` checks.

use crate::runtime::HostState;
use broker_capabilities::bindings::{
    self, BrokerError, Instance, InstanceId, InstancePage, ListedInstance, PageRequest, ProviderInfo,
    StartInstanceParams, StartInstanceResult, v0_1, v0_2,
};
use broker_capabilities::rooms::context::CallContext;
use std::sync::OnceLock;
use wasmtime::Store;
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
/// An export answering `R`, typed once it is first called.
type Export<P, R> = OnceLock<TypedFunc<P, (R,)>>;

/// One instance's exports, each typed when first called.
pub(crate) struct Exports {
    instance: GuestInstance,
    at: Indices,
    paged: bool,
    describe: Export<(), ProviderInfo>,
    validate_config: Export<(String,), Refusable<()>>,
    start_instance: Export<(Ctx, StartInstanceParams), Refusable<StartInstanceResult>>,
    stop_instances: Export<(Ctx, Vec<InstanceId>), Refusable<()>>,
    all_instances_paged: Export<(Ctx, PageRequest), Refusable<InstancePage>>,
    all_instances_whole: Export<(Ctx,), Refusable<Vec<Instance>>>,
    maintain_instance: Export<(Ctx, InstanceId, StartInstanceParams), Refusable<()>>,
}

impl ExportsPre {
    /// The exports of `version` (one of `bindings::SERVED_VERSIONS`) in `pre`,
    /// every one type-checked against that version's contract.
    pub(crate) fn new(version: &str, pre: InstancePre<HostState>) -> wasmtime::Result<ExportsPre> {
        // The generated check of the whole interface, with its errors' words.
        match version {
            "0.1.0" => drop(v0_1::ProviderPre::new(pre.clone())?),
            "0.2.0" => drop(v0_2::ProviderPre::new(pre.clone())?),
            _ => drop(bindings::ProviderPre::new(pre.clone())?),
        }
        let component = pre.component();
        let interface = format!("{}/instance-broker@{version}", bindings::CONTRACT_PACKAGE);
        let (_, broker) = component
            .get_export(None, &interface)
            .ok_or_else(|| wasmtime::format_err!("no export `{interface}` found"))?;
        let func = |name: &str| {
            component
                .get_export_index(Some(&broker), name)
                .ok_or_else(|| wasmtime::format_err!("export `{interface}` has no function `{name}`"))
        };
        let at = Indices {
            describe: func("describe")?,
            validate_config: func("validate-config")?,
            start_instance: func("start-instance")?,
            stop_instances: func("stop-instances")?,
            all_instances: func("all-instances")?,
            maintain_instance: func("maintain-instance")?,
        };
        let paged = !matches!(version, "0.1.0" | "0.2.0");
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

/// What `all-instances` answered, as the host reads it.
pub(crate) enum Listing {
    /// One page of a paging provider (0.3.0 on).
    Page(InstancePage),
    /// Every instance at once (0.2.0 and before), as listed instances.
    Whole(Vec<ListedInstance>),
}

/// The export at `index` of `instance` as `TypedFunc<P, R>`: type-checked the
/// first time (kept in `typed`), as it is from then on.
fn typed<P, R>(
    store: &mut Store<HostState>,
    instance: &GuestInstance,
    index: &ComponentExportIndex,
    typed: &OnceLock<TypedFunc<P, R>>,
) -> wasmtime::Result<TypedFunc<P, R>>
where
    P: ComponentNamedList + Lower,
    R: ComponentNamedList + Lift,
{
    if let Some(func) = typed.get() {
        return Ok(*func);
    }
    let func = instance.get_typed_func::<P, R>(&mut *store, index)?;
    Ok(*typed.get_or_init(|| func))
}

/// A borrow of the call's context, for one export call.
fn lend(ctx: &Ctx) -> Ctx {
    Resource::new_borrow(ctx.rep())
}

impl Exports {
    /// `describe`: who the provider is.
    pub(crate) async fn describe(&self, store: &mut Store<HostState>) -> wasmtime::Result<ProviderInfo> {
        let func = typed(store, &self.instance, &self.at.describe, &self.describe)?;
        Ok(func.call_async(&mut *store, ()).await?.0)
    }

    /// `validate-config` of `config` (JSON).
    pub(crate) async fn validate_config(
        &self,
        store: &mut Store<HostState>,
        config: String,
    ) -> wasmtime::Result<Refusable<()>> {
        let func = typed(store, &self.instance, &self.at.validate_config, &self.validate_config)?;
        Ok(func.call_async(&mut *store, (config,)).await?.0)
    }

    /// `start-instance` with `params`.
    pub(crate) async fn start_instance(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        params: StartInstanceParams,
    ) -> wasmtime::Result<Result<StartInstanceResult, BrokerError>> {
        let func = typed(store, &self.instance, &self.at.start_instance, &self.start_instance)?;
        Ok(func.call_async(&mut *store, (lend(ctx), params)).await?.0)
    }

    /// `stop-instances` of `ids`.
    pub(crate) async fn stop_instances(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        ids: Vec<InstanceId>,
    ) -> wasmtime::Result<Refusable<()>> {
        let func = typed(store, &self.instance, &self.at.stop_instances, &self.stop_instances)?;
        Ok(func.call_async(&mut *store, (lend(ctx), ids)).await?.0)
    }

    /// `maintain-instance` of `id`, started with `params`.
    pub(crate) async fn maintain_instance(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        id: InstanceId,
        params: StartInstanceParams,
    ) -> wasmtime::Result<Refusable<()>> {
        let func = typed(store, &self.instance, &self.at.maintain_instance, &self.maintain_instance)?;
        Ok(func.call_async(&mut *store, (lend(ctx), id, params)).await?.0)
    }

    /// `all-instances` of whichever version: a page of the current one (asked
    /// with `page`), or an older one's whole answer (`page` unused).
    pub(crate) async fn all_instances(
        &self,
        store: &mut Store<HostState>,
        ctx: &Ctx,
        page: &PageRequest,
    ) -> wasmtime::Result<Result<Listing, BrokerError>> {
        if self.paged {
            let func = typed(store, &self.instance, &self.at.all_instances, &self.all_instances_paged)?;
            let answer = func.call_async(&mut *store, (lend(ctx), page.clone())).await?.0;
            Ok(answer.map(Listing::Page))
        } else {
            let func = typed(store, &self.instance, &self.at.all_instances, &self.all_instances_whole)?;
            let answer = func.call_async(&mut *store, (lend(ctx),)).await?.0;
            Ok(answer.map(whole))
        }
    }
}

/// An older version's answer: instances with nothing more known of them.
fn whole(instances: Vec<Instance>) -> Listing {
    let listed = |instance| ListedInstance { instance, display_name: String::new(), hardware: None, tags: Vec::new() };
    Listing::Whole(instances.into_iter().map(listed).collect())
}
