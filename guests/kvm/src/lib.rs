//! The KVM provider: Juju's `NewKVMBroker` as a component. It decides (sizes,
//! names, the qemu command, the seed); the host acts through the capabilities
//! the manifest grants: `process` (qemu-img, genisoimage, qemu), `network-bridge`
//! (taps), `local-socket` (QMP) and the data dir (disks, seeds, consoles).

mod qmp;
mod vm;

use broker_guest::network_bridge;
use broker_guest::types::{
    Address, BrokerError, HardwareCharacteristics, Instance, InstancePage, InstanceStatus, InterfaceInfo,
    ListedInstance, PageRequest, ProviderInfo, StartInstanceParams, StartInstanceResult,
};
use broker_guest::{CallContext, Guest, host_kv, host_log};
use kvm_logic::spec::{self, Nic, Wanted};
use kvm_logic::{Config, KvmError};

struct Kvm;

fn from_logic(err: KvmError) -> BrokerError {
    match err {
        KvmError::InvalidParams(m) => BrokerError::InvalidParams(m),
        KvmError::NotFound(m) => BrokerError::NotFound(m),
        KvmError::Provider(m) => BrokerError::Provider(m),
    }
}

fn config(ctx: &CallContext) -> Result<Config, BrokerError> {
    Config::parse(&ctx.provider_config()).map_err(from_logic)
}

fn nics(config: &Config, name: &str, seq: u64, network: &[InterfaceInfo]) -> Result<Vec<Nic>, BrokerError> {
    network
        .iter()
        .enumerate()
        .map(|(i, info)| {
            if info.parent_interface_name.is_empty() {
                return Err(BrokerError::InvalidParams(format!(
                    "network interface {i} names no parent bridge for its tap"
                )));
            }
            let mac = if info.mac_address.is_empty() { spec::generated_mac(name, i) } else { info.mac_address.clone() };
            Ok(Nic { tap: spec::tap_name(config, seq, i), bridge: info.parent_interface_name.clone(), mac })
        })
        .collect()
}

/// What a VM got: its size, and how qemu runs it (`kvm`, or `qemu` for TCG).
fn characteristics(mem: u64, cores: u64, root_disk: u64, virt_type: String) -> HardwareCharacteristics {
    HardwareCharacteristics {
        arch: Some("amd64".into()),
        mem: Some(mem),
        root_disk: Some(root_disk),
        root_disk_source: None,
        cpu_cores: Some(cores),
        cpu_power: None,
        tags: None,
        availability_zone: None,
        virt_type: Some(virt_type),
    }
}

fn instance(name: &str, status: InstanceStatus, message: String, addresses: Vec<Address>) -> Instance {
    Instance { id: name.to_owned(), status, message, addresses }
}

impl Guest for Kvm {
    fn describe() -> ProviderInfo {
        ProviderInfo {
            name: "kvm".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            features: vec!["networking".into(), broker_guest::listing::ID_ORDERED_PAGES.into()],
        }
    }

    fn validate_config(config: String) -> Result<(), BrokerError> {
        Config::parse(&config).map(|_| ()).map_err(from_logic)
    }

    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        let config = config(ctx)?;
        ctx.set_status(InstanceStatus::Provisioning, "Creating instance", &[])?;
        let c = &params.constraints;
        let wanted = Wanted {
            arch: c.arch.clone(),
            mem: c.mem,
            cores: c.cores,
            root_disk: c.root_disk.or(params.root_disk.as_ref().map(|d| d.size)),
            virt_type: c.virt_type.clone(),
        };
        let size = spec::size(&config, &wanted).map_err(from_logic)?;
        let image = params.image_metadata.iter().find(|m| m.virt_type.as_deref().is_none_or(|v| v == "kvm"));
        let boot = spec::boot(&config, image.map(|m| m.extra.as_slice()).unwrap_or_default()).map_err(from_logic)?;
        let instance_config = params.instance_config.as_ref();
        let seq = host_kv::increment("seq", 1)? as u64;
        let name = spec::vm_name(&config, instance_config.map(|ic| ic.machine_id.as_str()), seq).map_err(from_logic)?;
        if vm::load(&name)?.is_some() {
            return Err(BrokerError::InvalidParams(format!("VM {name} already exists")));
        }
        let nics = nics(&config, &name, seq, &params.network_info)?;
        let plan = vm::Plan {
            config: &config,
            seed_network: broker_guest::netplan::network_config(&broker_guest::netplan::interfaces(
                &params.network_info,
                &nics.iter().map(|nic| nic.mac.clone()).collect::<Vec<_>>(),
            )),
            name,
            seq,
            size,
            boot,
            nics,
            user_data: instance_config.and_then(|ic| ic.user_data.clone()),
        };
        if ctx.aborted() {
            return Err(BrokerError::Aborted("start-instance aborted before the VM was made".into()));
        }
        // Durable with the host before anything of the VM is made: a host
        // killed from here on adopts it on restart instead of losing it.
        ctx.claim_instance_id(&plan.name)?;
        let starting = || ctx.set_status(InstanceStatus::Provisioning, "Starting instance", &[]);
        let virt_type = match vm::create(&plan, starting) {
            Ok(virt_type) => virt_type,
            Err(err) => {
                // Undo everything; the cause is what the caller needs to see.
                if let Err(cleanup) = vm::teardown(&plan.name, plan.seq, &plan.nics, 0) {
                    host_log::log(host_log::Level::Warn, &format!("cleaning up {}: {cleanup:?}", plan.name));
                }
                let cause = err.message().to_owned();
                let _ = ctx.set_status(InstanceStatus::ProvisioningError, &cause, &[]);
                return Err(err);
            }
        };
        ctx.set_status(InstanceStatus::Running, "Instance started", &[])?;

        let addresses: Vec<Address> = params.network_info.iter().flat_map(|n| n.addresses.clone()).collect();
        let mut network_info = params.network_info.clone();
        for (info, nic) in network_info.iter_mut().zip(&plan.nics) {
            info.mac_address = nic.mac.clone();
        }
        Ok(StartInstanceResult {
            display_name: plan.name.clone(),
            instance: instance(&plan.name, InstanceStatus::Running, String::new(), addresses),
            config: Vec::new(),
            hardware: Some(characteristics(plan.size.mem, plan.size.cores, plan.size.root_disk, virt_type)),
            network_info,
            volumes: Vec::new(),
            volume_attachments: Vec::new(),
        })
    }

    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        let config = config(ctx)?;
        let prefix = spec::prefix(&config);
        for id in ids.iter().filter(|id| id.starts_with(&prefix)) {
            // Unknown ids are ignored, as Juju's brokers do.
            if let Some(record) = vm::load(id)? {
                vm::teardown(id, record.seq, &record.nics, config.stop_grace_ms)?;
            }
        }
        Ok(())
    }

    /// A page of the VMs kept one record per kv key.
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError> {
        let prefix = spec::prefix(&config(ctx)?);
        broker_guest::listing::kv_page(spec::RECORD_PREFIX, &page, |key, bytes| {
            let name = &key[spec::RECORD_PREFIX.len()..];
            if !name.starts_with(&prefix) {
                return Ok(None);
            }
            let record = vm::decode(name, bytes)?;
            let (status, message) = vm::observe(&record);
            Ok(Some(ListedInstance {
                instance: instance(name, status, message, Vec::new()),
                display_name: name.to_owned(),
                hardware: Some(characteristics(record.mem, record.cores, record.root_disk, record.virt_type.clone())),
                tags: Vec::new(),
            }))
        })
    }

    fn maintain_instance(ctx: &CallContext, id: String, _params: StartInstanceParams) -> Result<(), BrokerError> {
        config(ctx)?;
        let record = vm::load(&id)?.ok_or_else(|| BrokerError::NotFound(format!("no VM {id}")))?;
        match vm::observe(&record) {
            (InstanceStatus::Running | InstanceStatus::Stopped, _) => {}
            (_, why) => return Err(BrokerError::Provider(format!("VM {id} cannot be re-adopted: {why}"))),
        }
        let present: Vec<String> = network_bridge::devices()?.into_iter().map(|d| d.name).collect();
        for nic in record.nics.iter().filter(|nic| !present.contains(&nic.tap)) {
            network_bridge::create_tap(&nic.tap, &nic.bridge, &spec::tap_mac(&nic.mac))?;
            host_log::log(host_log::Level::Warn, &format!("VM {id}: recreated missing tap {}", nic.tap));
        }
        Ok(())
    }
}

broker_guest::export_provider!(Kvm);
