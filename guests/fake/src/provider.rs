//! The fake provider: the contract mapped onto `fake_logic`. Its helpers are
//! `pub(crate)` for the builds that include this file (fake-next, test-broken).

use broker_guest::types::{
    Address, AddressConfigType, AddressKind, AddressScope, BrokerError, HardwareCharacteristics, Instance,
    InstancePage, InstanceStatus, ListedInstance, PageRequest, ProviderInfo, StartInstanceParams, StartInstanceResult,
    Volume, VolumeAttachment,
};
use broker_guest::{CallContext, Guest, host_kv};
use fake_logic::{FakeError, FakeInstance, Hardware, StartRequest};

pub struct Fake;

/// The host's kv, as `fake_logic` wants it.
pub(crate) struct HostKv;

impl fake_logic::Kv for HostKv {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, FakeError> {
        host_kv::get(key).map_err(storage)
    }
    fn set(&self, key: &str, value: &[u8]) -> Result<(), FakeError> {
        host_kv::set(key, value).map_err(storage)
    }
    fn delete(&self, key: &str) -> Result<bool, FakeError> {
        host_kv::delete(key).map_err(storage)
    }
    fn increment(&self, key: &str, delta: i64) -> Result<i64, FakeError> {
        host_kv::increment(key, delta).map_err(storage)
    }
    fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, FakeError> {
        broker_guest::kv::scan(prefix).map_err(storage)
    }
}

/// The host's refusal of a claimed id, as the fake's error.
fn claim_refused(err: BrokerError) -> FakeError {
    match err {
        BrokerError::InvalidParams(m) => FakeError::InvalidParams(m),
        other => FakeError::Storage(format!("{other:?}")),
    }
}

fn storage(err: host_kv::KvError) -> FakeError {
    FakeError::Storage(format!("{err:?}"))
}

pub(crate) fn to_broker_error(err: FakeError) -> BrokerError {
    match err {
        FakeError::InvalidParams(m) => BrokerError::InvalidParams(m),
        FakeError::NotFound(m) => BrokerError::NotFound(m),
        FakeError::ZoneIndependent(m) => BrokerError::ZoneIndependent(m),
        FakeError::ZoneUnavailable(m) => BrokerError::ZoneUnavailable(m),
        FakeError::Storage(m) => BrokerError::Provider(m),
    }
}

fn config(ctx: &CallContext) -> Result<fake_logic::Config, BrokerError> {
    fake_logic::Config::parse(&ctx.provider_config()).map_err(to_broker_error)
}

fn knobs(ctx: &CallContext) -> fake_logic::Knobs {
    fake_logic::Knobs::read(&ctx.provider_config())
}

/// Key under which the fake keeps the params it was started with, so a test
/// can check that every field crossed the boundary intact.
fn params_key(id: &str) -> String {
    format!("params/{id}")
}

/// Its name for people: the id, and the Juju machine it is.
fn display_name(fake: &FakeInstance) -> String {
    match &fake.machine_id {
        Some(machine) => format!("{} (machine {machine})", fake.id),
        None => fake.id.clone(),
    }
}

pub(crate) fn hardware(h: &Hardware) -> HardwareCharacteristics {
    HardwareCharacteristics {
        arch: h.arch.clone(),
        mem: h.mem,
        root_disk: h.root_disk,
        root_disk_source: h.root_disk_source.clone(),
        cpu_cores: h.cpu_cores,
        cpu_power: h.cpu_power,
        tags: h.tags.clone(),
        availability_zone: h.availability_zone.clone(),
        virt_type: h.virt_type.clone(),
    }
}

fn address(value: &str) -> Address {
    let kind = if value.contains(':') { AddressKind::Ipv6 } else { AddressKind::Ipv4 };
    Address {
        value: value.to_owned(),
        kind,
        scope: AddressScope::LocalCloud,
        cidr: None,
        config_type: AddressConfigType::Static,
    }
}

pub(crate) fn instance(fake: &FakeInstance) -> Instance {
    Instance {
        id: fake.id.clone(),
        status: InstanceStatus::Running,
        message: String::new(),
        addresses: fake.addresses.iter().map(|a| address(a)).collect(),
    }
}

pub(crate) fn request(params: &StartInstanceParams, distribution_group: Vec<String>) -> StartRequest {
    let c = &params.constraints;
    StartRequest {
        machine_id: params.instance_config.as_ref().map(|ic| ic.machine_id.clone()),
        wanted: Hardware {
            arch: c.arch.clone(),
            mem: c.mem,
            root_disk: c.root_disk.or(params.root_disk.as_ref().map(|d| d.size)),
            root_disk_source: c.root_disk_source.clone(),
            cpu_cores: c.cores,
            cpu_power: c.cpu_power,
            tags: c.tags.clone(),
            availability_zone: None,
            virt_type: c.virt_type.clone(),
        },
        zones_constraint: c.zones.clone(),
        placement: params.placement.clone(),
        availability_zone: params.availability_zone.clone(),
        distribution_group,
        addresses: params.network_info.iter().flat_map(|n| n.addresses.iter().map(|a| a.value.clone())).collect(),
    }
}

impl Guest for Fake {
    fn describe() -> ProviderInfo {
        let mut features: Vec<String> =
            ["zones", "placement", "volumes", "networking", broker_guest::listing::ID_ORDERED_PAGES]
                .into_iter()
                .map(Into::into)
                .collect();
        features.extend(fake_logic::listed_zones(&HostKv).into_iter().map(|z| format!("zone={z}")));
        ProviderInfo { name: "fake".into(), version: env!("CARGO_PKG_VERSION").into(), features }
    }

    fn validate_config(config: String) -> Result<(), BrokerError> {
        fake_logic::Config::parse(&config).map(|_| ()).map_err(to_broker_error)
    }

    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        let config = config(ctx)?;
        ctx.set_status(InstanceStatus::Allocating, "allocating instance", &[])?;
        if ctx.aborted() {
            return Err(BrokerError::Aborted("start-instance aborted before allocation".into()));
        }
        if config.start_delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(config.start_delay_ms));
        }
        let group = ctx.distribution_group()?;
        let claim = |id: &str| ctx.claim_instance_id(id).map_err(claim_refused);
        let fake =
            fake_logic::start_claiming(&HostKv, &config, request(&params, group), claim).map_err(to_broker_error)?;
        if config.answer_delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(config.answer_delay_ms));
        }
        let recorded = serde_json::to_vec(&params).map_err(|e| BrokerError::Provider(e.to_string()))?;
        host_kv::set(&params_key(&fake.id), &recorded)?;
        ctx.set_status(InstanceStatus::Running, "", &[])?;

        let volumes = params
            .volumes
            .iter()
            .enumerate()
            .map(|(i, v)| Volume {
                tag: v.tag.clone(),
                volume_id: format!("{}-vol-{i}", fake.id),
                hardware_id: None,
                wwn: None,
                size: v.size,
                persistent: false,
            })
            .collect();
        let volume_attachments = params
            .volume_attachments
            .iter()
            .enumerate()
            .map(|(i, a)| VolumeAttachment {
                volume: a.volume.clone(),
                machine: a.machine.clone(),
                device_name: Some(format!("vd{}", char::from(b'b' + (i % 24) as u8))),
                device_link: None,
                bus_address: None,
                read_only: a.read_only,
            })
            .collect();
        // Which build answered: hot-swap tests tell versions apart by it.
        let mut config_out = vec![("provider-version".to_owned(), env!("CARGO_PKG_VERSION").to_owned())];
        if !params.controller_uuid.is_empty() {
            config_out.push(("controller-uuid".to_owned(), params.controller_uuid.clone()));
        }
        Ok(StartInstanceResult {
            display_name: display_name(&fake),
            instance: instance(&fake),
            config: config_out,
            hardware: Some(hardware(&fake.hardware)),
            network_info: params.network_info,
            volumes,
            volume_attachments,
        })
    }

    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        if knobs(ctx).stops_fail {
            return Err(BrokerError::Provider(format!(
                "stopping {} instances failed (fake config stops-fail)",
                ids.len()
            )));
        }
        fake_logic::stop(&HostKv, &ids).map_err(to_broker_error)?;
        for id in &ids {
            host_kv::delete(&params_key(id))?;
        }
        Ok(())
    }

    /// A page of the instances the fake keeps one per kv key.
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError> {
        // Read for a page that lists something, once: an empty page costs
        // no host call for the config and no parse of it.
        let mut failed_zones = None;
        broker_guest::listing::kv_page(fake_logic::INSTANCE_PREFIX, &page, |_, value| {
            let fake = fake_logic::decode(value).map_err(to_broker_error)?;
            let mut listed = instance(&fake);
            let failed_zones = failed_zones.get_or_insert_with(|| knobs(ctx).failed_zones);
            if let Some(zone) = fake.hardware.availability_zone.as_ref().filter(|z| failed_zones.contains(z)) {
                listed.status = InstanceStatus::Error;
                listed.message = format!("zone {zone} fails its instances (fake config failed-zones)");
            }
            Ok(Some(ListedInstance {
                display_name: display_name(&fake),
                hardware: Some(hardware(&fake.hardware)),
                tags: Vec::new(),
                instance: listed,
            }))
        })
    }

    fn maintain_instance(ctx: &CallContext, id: String, params: StartInstanceParams) -> Result<(), BrokerError> {
        if let Some(tag) = knobs(ctx).unhealthy_tag {
            let tags = params.instance_config.as_ref().map(|ic| ic.tags.as_slice()).unwrap_or_default();
            if tags.iter().any(|(key, _)| *key == tag) {
                return Err(BrokerError::Provider(format!(
                    "instance {id} is not healthy (it carries tag {tag}: fake config unhealthy-tag)"
                )));
            }
        }
        fake_logic::maintain(&HostKv, &id).map(|_| ()).map_err(to_broker_error)
    }
}
