//! The LXD provider: Juju's LXD broker as a component. It speaks the LXD REST
//! API (which Incus shares) through plain `wasi:http`; the host routes the
//! configured authority to the socket the manifest grants, and nothing else.

mod client;
mod http;

use broker_guest::types::{
    BrokerError, HardwareCharacteristics, ImageMetadata, Instance, InstancePage, InstanceStatus, InterfaceInfo,
    ListedInstance, PageRequest, ProviderInfo, StartInstanceParams, StartInstanceResult,
};
use broker_guest::{CallContext, Guest, host_kv, host_log};
use client::Lxd;
use lxd_logic::api::{self, State};
use lxd_logic::spec::{self, Nic, Wanted};
use lxd_logic::{Config, LxdError};
use wasip2::http::types::Method;

struct LxdProvider;

pub(crate) fn from_logic(err: LxdError) -> BrokerError {
    match err {
        LxdError::InvalidParams(m) => BrokerError::InvalidParams(m),
        LxdError::NotFound(m) => BrokerError::NotFound(m),
        LxdError::Provider(m) => BrokerError::Provider(m),
    }
}

fn config(ctx: &CallContext) -> Result<Config, BrokerError> {
    Config::parse(&ctx.provider_config()).map_err(from_logic)
}

/// The image: an alias from the image metadata (`extra` "alias", else its id), else the config's.
fn image_alias(config: &Config, images: &[ImageMetadata]) -> Result<String, BrokerError> {
    let ours = images.iter().find(|m| m.virt_type.as_deref().is_none_or(|v| matches!(v, "lxd" | "container")));
    let from_metadata = ours
        .map(|m| m.extra.iter().find(|(k, _)| k == "alias").map(|(_, v)| v.clone()).unwrap_or_else(|| m.id.clone()));
    from_metadata.filter(|a| !a.is_empty()).or_else(|| config.image_alias.clone()).ok_or_else(|| {
        BrokerError::InvalidParams(
            "no image: give image metadata with an alias, or set image-alias in the provider config".into(),
        )
    })
}

/// A bridged NIC per network-info entry; Juju's fallback on the default bridge when there are none.
fn wanted_nics(config: &Config, network: &[InterfaceInfo]) -> Result<Vec<Nic>, BrokerError> {
    if network.is_empty() {
        return Ok(config
            .default_bridge
            .iter()
            .map(|bridge| Nic { device: "eth0".into(), parent: bridge.clone(), ..Nic::default() })
            .collect());
    }
    network
        .iter()
        .enumerate()
        .map(|(i, info)| {
            if info.parent_interface_name.is_empty() {
                return Err(BrokerError::InvalidParams(format!("network interface {i} names no parent bridge")));
            }
            let device = if info.interface_name.is_empty() { format!("eth{i}") } else { info.interface_name.clone() };
            Ok(Nic {
                device,
                parent: info.parent_interface_name.clone(),
                hwaddr: info.mac_address.clone(),
                mtu: info.mtu,
            })
        })
        .collect()
}

fn status(state: State) -> InstanceStatus {
    match state {
        State::Running => InstanceStatus::Running,
        State::Stopped => InstanceStatus::Stopped,
        State::Pending => InstanceStatus::Pending,
        State::Error => InstanceStatus::Error,
        State::Unknown => InstanceStatus::Unknown,
    }
}

/// Remove a container: forced stop if it runs, then `DELETE` with up to 3
/// tries. Not found counts as removed.
fn remove(lxd: &Lxd, name: &str) -> Result<(), BrokerError> {
    let Some(instance) = lxd.instance(name)? else { return Ok(()) };
    // Anything but stopped (running, frozen, starting) is stopped with force first.
    if instance["status"] != "Stopped"
        && let Err((_, message)) = lxd.change_state(name, "stop", true)?
    {
        host_log::log(host_log::Level::Warn, &format!("stopping {name}: {message}"));
    }
    let mut last = String::new();
    for attempt in 0..3 {
        if attempt > 0 {
            wasip2::clocks::monotonic_clock::subscribe_duration(500_000_000 * attempt).block();
        }
        match lxd.act(Method::Delete, &format!("/1.0/instances/{name}"), None)? {
            Ok(()) | Err((404, _)) => return Ok(()),
            Err((_, message)) if lxd.instance(name)?.is_none() => {
                host_log::log(host_log::Level::Debug, &format!("deleting {name}: {message}; it is gone anyway"));
                return Ok(());
            }
            Err((_, message)) => last = message,
        }
    }
    Err(BrokerError::Provider(format!("cannot delete container {name} after 3 tries: {last}")))
}

/// Create (or accept an identical existing) container and start it. An
/// existing container with another spec is never touched: it may not be ours.
fn create_and_start(lxd: &Lxd, spec: &spec::ContainerSpec) -> Result<(), BrokerError> {
    let name = &spec.name;
    let existing = match lxd.instance(name)? {
        Some(instance) => Some(instance),
        None => match lxd.act(Method::Post, "/1.0/instances", Some(&spec.create_body()))? {
            Ok(()) => None,
            // Made by someone else between the look and the create? (Incus says
            // so only as a database constraint in the failed operation.)
            Err((_, message)) => Some(lxd.instance(name)?.ok_or(BrokerError::Provider(message))?),
        },
    };
    if let Some(existing) = &existing {
        let differences = spec.differences(existing);
        if !differences.is_empty() {
            return Err(BrokerError::InvalidParams(format!(
                "container {name} already exists with a different spec: {}",
                differences.join("; ")
            )));
        }
    }
    // A container this call created is stopped; only an existing one may already run.
    let running = existing.is_some_and(|i| api::instance_state(&i).0 == State::Running);
    if !running && let Err((_, message)) = lxd.change_state(name, "start", false)? {
        if let Err(cleanup) = remove(lxd, name) {
            host_log::log(
                host_log::Level::Warn,
                &format!("removing {name} after a failed start: {}", cleanup.message()),
            );
        }
        return Err(BrokerError::Provider(format!("starting {name}: {message}")));
    }
    Ok(())
}

impl Guest for LxdProvider {
    fn describe() -> ProviderInfo {
        ProviderInfo {
            name: "lxd".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            features: vec!["networking".into(), broker_guest::listing::ID_ORDERED_PAGES.into()],
        }
    }

    fn validate_config(config: String) -> Result<(), BrokerError> {
        Config::parse(&config).map(|_| ()).map_err(from_logic)
    }

    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        let config = config(ctx)?;
        let lxd = Lxd::new(&config);
        ctx.set_status(InstanceStatus::Provisioning, "Creating container spec", &[])?;
        let failed = |err: BrokerError| {
            let err = err.map_message(|m| format!("Creating container: {m}"));
            let _ = ctx.set_status(InstanceStatus::ProvisioningError, err.message(), &[]);
            err
        };
        let c = &params.constraints;
        let wanted = Wanted {
            arch: c.arch.clone(),
            cores: c.cores,
            mem: c.mem,
            root_disk: c.root_disk.or(params.root_disk.as_ref().map(|d| d.size)),
            virt_type: c.virt_type.clone(),
        };
        let instance_config = params.instance_config.as_ref();
        let user_data = match instance_config.and_then(|ic| ic.user_data.clone()) {
            None => None,
            Some(bytes) => Some(
                String::from_utf8(bytes)
                    .map_err(|_| failed(BrokerError::InvalidParams("user-data is not UTF-8 text".into())))?,
            ),
        };
        let alias = image_alias(&config, &params.image_metadata).map_err(failed)?;
        let nics = wanted_nics(&config, &params.network_info).map_err(failed)?;
        let seq = host_kv::increment("seq", 1)? as u64;
        let name = spec::container_name(&config, instance_config.map(|ic| ic.machine_id.as_str()), seq)
            .map_err(|e| failed(from_logic(e)))?;
        let macs: Vec<String> = nics.iter().map(|n| n.hwaddr.clone()).collect();
        let network_config = (!params.network_info.is_empty()).then(|| netplan_json(&params.network_info, &macs));
        let spec = spec::container_spec(
            &config,
            spec::Request {
                name,
                alias,
                wanted: &wanted,
                nics: &nics,
                user_data,
                network_config,
                charm_profiles: &params.charm_lxd_profiles,
                tags: instance_config.map(|ic| ic.tags.as_slice()).unwrap_or_default(),
            },
        )
        .map_err(|e| failed(from_logic(e)))?;

        ctx.set_status(InstanceStatus::Provisioning, "acquiring LXD image", &[])?;
        if !lxd.image_alias_exists(&spec.alias).map_err(failed)? {
            return Err(failed(BrokerError::NotFound(format!(
                "image alias {:?} not found in LXD project {:?}",
                spec.alias, config.project
            ))));
        }
        if ctx.aborted() {
            return Err(failed(BrokerError::Aborted("start-instance aborted before the container was made".into())));
        }
        // Durable with the host before the container exists: a host killed
        // from here on adopts it on restart instead of losing it.
        ctx.claim_instance_id(&spec.name).map_err(failed)?;
        ctx.set_status(InstanceStatus::Provisioning, "Creating container", &[])?;
        create_and_start(&lxd, &spec).map_err(failed)?;

        let instance = lxd.instance(&spec.name).map_err(failed)?.ok_or_else(|| {
            failed(BrokerError::Provider(format!("container {} vanished after it started", spec.name)))
        })?;
        ctx.set_status(InstanceStatus::Running, "Container started", &[])?;
        let reported = api::nics(&instance);
        let mut network_info = params.network_info.clone();
        for (info, nic) in network_info.iter_mut().zip(&nics) {
            if let Some(found) = reported.iter().find(|r| r.device == nic.device) {
                info.mac_address = found.hwaddr.clone();
            }
        }
        let addresses = params.network_info.iter().flat_map(|n| n.addresses.clone()).collect();
        Ok(StartInstanceResult {
            display_name: spec.name.clone(),
            instance: Instance {
                id: spec.name.clone(),
                status: InstanceStatus::Running,
                message: String::new(),
                addresses,
            },
            config: vec![("lxd-project".into(), config.project.clone()), ("image-alias".into(), spec.alias.clone())],
            hardware: Some(HardwareCharacteristics {
                root_disk_source: wanted.root_disk.map(|_| config.storage_pool.clone()),
                ..characteristics(api::hardware(&instance))
            }),
            network_info,
            volumes: Vec::new(),
            volume_attachments: Vec::new(),
        })
    }

    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        let config = config(ctx)?;
        let lxd = Lxd::new(&config);
        let prefix = spec::prefix(&config);
        // Sequential, first error returns; ids that are not this host's are ignored.
        for id in ids.iter().filter(|id| id.starts_with(&prefix)) {
            remove(&lxd, id)?;
        }
        Ok(())
    }

    /// LXD lists a project's containers at once: the page is cut from that.
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError> {
        let config = config(ctx)?;
        let prefix = spec::prefix(&config);
        let mut out = Vec::new();
        for instance in Lxd::new(&config).instances()? {
            let Some(name) = instance["name"].as_str().filter(|n| n.starts_with(&prefix)) else { continue };
            let (state, message) = api::instance_state(&instance);
            out.push(ListedInstance {
                instance: Instance { id: name.to_owned(), status: status(state), message, addresses: Vec::new() },
                display_name: name.to_owned(),
                hardware: Some(characteristics(api::hardware(&instance))),
                tags: Vec::new(),
            });
        }
        Ok(broker_guest::listing::page_of(out, &page))
    }

    fn maintain_instance(ctx: &CallContext, id: String, params: StartInstanceParams) -> Result<(), BrokerError> {
        let config = config(ctx)?;
        let instance = Lxd::new(&config)
            .instance(&id)?
            .ok_or_else(|| BrokerError::NotFound(format!("no container {id} in LXD project {:?}", config.project)))?;
        let differences = api::nic_differences(&wanted_nics(&config, &params.network_info)?, &api::nics(&instance));
        if !differences.is_empty() {
            return Err(BrokerError::Provider(format!("container {id}: {}", differences.join("; "))));
        }
        Ok(())
    }
}

/// What LXD says a container got, in the contract's terms.
fn characteristics(hardware: lxd_logic::api::Hardware) -> HardwareCharacteristics {
    HardwareCharacteristics {
        arch: hardware.arch,
        mem: hardware.mem,
        root_disk: hardware.root_disk,
        root_disk_source: None,
        cpu_cores: hardware.cores,
        cpu_power: None,
        tags: None,
        availability_zone: None,
        virt_type: Some("container".into()),
    }
}

fn netplan_json(network: &[InterfaceInfo], macs: &[String]) -> String {
    broker_guest::netplan::network_config(&broker_guest::netplan::interfaces(network, macs)).to_string()
}

broker_guest::export_provider!(LxdProvider);
