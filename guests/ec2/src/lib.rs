//! The EC2 provider: Juju's EC2 broker as a component. It sends unsigned EC2
//! Query API requests to the authority its config names; the host signs them
//! with a credential this component never sees, and refuses what the grant's
//! rules do not allow before anything leaves.

mod client;

use broker_guest::types::{
    Address, AddressConfigType, AddressKind, AddressScope, BrokerError, HardwareCharacteristics, Instance,
    InstancePage, InstanceStatus, ListedInstance, PageRequest, ProviderInfo, StartInstanceParams, StartInstanceResult,
};
use broker_guest::{CallContext, Guest, host_kv, host_log};
use client::{Ec2, from_logic};
use ec2_logic::api::Ec2Instance;
use ec2_logic::select::{self, ImageCandidate, Wanted, ZoneRequest};
use ec2_logic::{Config, query};
use std::collections::BTreeMap;
use std::time::Duration;

struct Ec2Provider;

/// The kv key holding the zones the region last reported, which `describe` lists.
const ZONES_KEY: &str = "zones";
/// At most this many zones are listed by `describe`.
const MAX_LISTED_ZONES: usize = 64;
/// How often a start looks whether its instance runs yet.
const POLL: Duration = Duration::from_secs(1);

fn config(ctx: &CallContext) -> Result<Config, BrokerError> {
    Config::parse(&ctx.provider_config()).map_err(from_logic)
}

fn status(state: &str) -> InstanceStatus {
    match state {
        "pending" => InstanceStatus::Provisioning,
        "running" => InstanceStatus::Running,
        "shutting-down" | "stopping" => InstanceStatus::Stopping,
        "stopped" | "terminated" => InstanceStatus::Stopped,
        _ => InstanceStatus::Unknown,
    }
}

fn addresses(instance: &Ec2Instance) -> Vec<Address> {
    let v4 = |value: &String, scope| Address {
        value: value.clone(),
        kind: AddressKind::Ipv4,
        scope,
        cidr: None,
        config_type: AddressConfigType::Dhcp,
    };
    let mut out: Vec<Address> = instance.private_ip.iter().map(|ip| v4(ip, AddressScope::LocalCloud)).collect();
    out.extend(instance.public_ip.iter().map(|ip| v4(ip, AddressScope::Public)));
    out
}

pub(crate) fn sleep(duration: Duration) {
    wasip2::clocks::monotonic_clock::subscribe_duration(duration.as_nanos() as u64).block();
}

fn instance_of(found: &Ec2Instance) -> Instance {
    let message = match found.state_reason.is_empty() {
        true => found.state.clone(),
        false => format!("{}: {}", found.state, found.state_reason),
    };
    Instance { id: found.id.clone(), status: status(&found.state), message, addresses: addresses(found) }
}

/// An instance as the listing has it: what its type says it got, and its tags.
fn listed_of(found: &Ec2Instance) -> ListedInstance {
    let known = select::INSTANCE_TYPES.iter().find(|t| t.name == found.instance_type);
    ListedInstance {
        instance: instance_of(found),
        display_name: found.tag("Name").unwrap_or_default().to_owned(),
        hardware: Some(HardwareCharacteristics {
            arch: found.arch().map(str::to_owned),
            mem: known.map(|t| t.mem),
            root_disk: None,
            root_disk_source: Some("ebs".into()),
            cpu_cores: known.map(|t| t.cores),
            cpu_power: known.map(|t| t.cpu_power),
            tags: None,
            availability_zone: Some(found.zone.clone()).filter(|zone| !zone.is_empty()),
            virt_type: Some("hvm".into()),
        }),
        tags: found.tags.clone(),
    }
}

/// Wait for `id` to run, telling the caller each state it passes. Gives up
/// (and the caller terminates it) on the config's deadline or an abort.
fn wait_running(ec2: &Ec2, ctx: &CallContext, id: &str) -> Result<Ec2Instance, BrokerError> {
    let started = wasip2::clocks::monotonic_clock::now();
    let limit = Duration::from_secs(ec2.config.wait_running_s).as_nanos() as u64;
    let mut said = String::new();
    loop {
        let looked = match ec2.ours(&[id.to_owned()]) {
            Ok(found) => found,
            // Throttled, or an answer lost: the instance may be fine; look again.
            Err(client::Failure::Transient(error)) => {
                host_log::log(host_log::Level::Warn, &format!("waiting for {id}: {}", error.message()));
                Vec::new()
            }
            Err(client::Failure::Final(error)) => return Err(error),
        };
        match looked.into_iter().next() {
            Some(found) if found.state == "running" => return Ok(found),
            Some(found) if matches!(found.state.as_str(), "shutting-down" | "terminated" | "stopping" | "stopped") => {
                return Err(BrokerError::Provider(format!(
                    "instance {id} went {} while starting",
                    instance_of(&found).message
                )));
            }
            Some(found) if found.state != said => {
                said = found.state.clone();
                ctx.set_status(InstanceStatus::Provisioning, &format!("instance {id} is {said}"), &[])?;
            }
            // Not listed yet: EC2's reads trail its writes.
            _ => {}
        }
        if ctx.aborted() {
            return Err(BrokerError::Aborted(format!("start-instance aborted while {id} was {said}")));
        }
        if wasip2::clocks::monotonic_clock::now().saturating_sub(started) > limit {
            return Err(BrokerError::Timeout(format!(
                "instance {id} not running after {}s (wait-running-s)",
                ec2.config.wait_running_s
            )));
        }
        sleep(POLL);
    }
}

impl Guest for Ec2Provider {
    fn describe() -> ProviderInfo {
        // The zones the region reported last (describe has no config to ask
        // with): the host places starts in them and moves on past a full one.
        let zones: Vec<String> = host_kv::get(ZONES_KEY)
            .ok()
            .flatten()
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .map(|text| text.lines().take(MAX_LISTED_ZONES).map(|z| format!("zone={z}")).collect())
            .unwrap_or_default();
        let mut features =
            vec!["zones".to_owned(), "placement".to_owned(), broker_guest::listing::ID_ORDERED_PAGES.to_owned()];
        features.extend(zones);
        ProviderInfo { name: "ec2".into(), version: env!("CARGO_PKG_VERSION").into(), features }
    }

    fn validate_config(config: String) -> Result<(), BrokerError> {
        Config::parse(&config).map(|_| ()).map_err(from_logic)
    }

    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        let ec2 = Ec2::new(config(ctx)?);
        let failed = |err: BrokerError| {
            let _ = ctx.set_status(InstanceStatus::ProvisioningError, err.message(), &[]);
            err
        };
        ctx.set_status(InstanceStatus::Provisioning, "choosing instance type, image and zone", &[])?;
        let c = &params.constraints;
        let wanted = Wanted {
            arch: c.arch.clone(),
            cores: c.cores,
            cpu_power: c.cpu_power,
            mem: c.mem,
            instance_type: c.instance_type.clone(),
        };
        let chosen = select::instance_type(&ec2.config, &wanted).map_err(from_logic).map_err(failed)?;
        let candidates: Vec<ImageCandidate> = (params.image_metadata.iter())
            .map(|m| ImageCandidate {
                id: m.id.clone(),
                arch: m.arch.clone(),
                region: m.region.clone(),
                virt_type: m.virt_type.clone(),
            })
            .collect();
        let image = select::image(&ec2.config, &chosen.arch, c.image_id.as_deref(), &candidates)
            .map_err(from_logic)
            .map_err(failed)?;
        let root_disk = c.root_disk.or(params.root_disk.as_ref().map(|d| d.size));

        let zones = ec2.zones().map_err(failed)?;
        let group = ctx.distribution_group()?;
        let mut group_per_zone: BTreeMap<String, usize> = BTreeMap::new();
        if !group.is_empty() {
            for member in ec2.ours(&group).map_err(|e| failed(e.into()))? {
                *group_per_zone.entry(member.zone).or_default() += 1;
            }
        }
        let zone_request = ZoneRequest {
            placement: params.placement.as_deref().filter(|p| !p.is_empty()),
            availability_zone: params.availability_zone.as_deref(),
            allowed: c.zones.as_deref(),
            group_per_zone,
        };
        let zone = select::zone(&ec2.config, &zones, &zone_request).map_err(from_logic).map_err(failed)?;

        let instance_config = params.instance_config.as_ref();
        // A machine's name, else a sequence's.
        let name = match instance_config.filter(|ic| !ic.machine_id.is_empty()) {
            Some(ic) => format!("juju-{}-machine-{}", ec2.config.namespace, ic.machine_id),
            None => format!("juju-{}-{}", ec2.config.namespace, host_kv::increment("seq", 1)?),
        };
        // The token is this call's own: RunInstances asked again within it
        // (an answer lost) gets the instance it made, while another start,
        // even of the same machine, is never answered with an instance
        // the host may already hold (and would refuse, and this would stop).
        let attempt = host_kv::increment("start-attempt", 1)?;
        let nonce = format!("{}/{attempt}", instance_config.map(|ic| ic.machine_nonce.as_str()).unwrap_or_default());
        let wanted_tags = instance_config.map(|ic| ic.tags.as_slice()).unwrap_or_default();
        let tags = query::instance_tags((&ec2.config.tag_key, &ec2.config.namespace), &name, wanted_tags)
            .map_err(|m| failed(BrokerError::InvalidParams(m)))?;
        let user_data = instance_config.and_then(|ic| ic.user_data.clone());
        if user_data.as_ref().is_some_and(|d| d.len() > query::MAX_USER_DATA) {
            return Err(failed(BrokerError::InvalidParams(format!(
                "user data is {} bytes; EC2 takes at most {}",
                user_data.as_ref().map_or(0, Vec::len),
                query::MAX_USER_DATA
            ))));
        }
        let spec = query::RunSpec {
            image_id: image.clone(),
            instance_type: chosen.name.clone(),
            zone: zone.clone(),
            client_token: query::client_token(&ec2.config.namespace, &nonce, &zone),
            user_data,
            tags,
            root_disk_gib: select::root_disk_gib(root_disk),
            subnet_id: ec2.config.subnet_id.clone(),
            security_group_ids: ec2.config.security_group_ids.clone(),
            key_name: ec2.config.key_name.clone(),
        };
        if ctx.aborted() {
            return Err(failed(BrokerError::Aborted("start-instance aborted before RunInstances".into())));
        }
        ctx.set_status(InstanceStatus::Allocating, &format!("running {} ({}) in {zone}", chosen.name, image), &[])?;
        let made = ec2.run(&spec).map_err(failed)?;
        let id = made.id.clone();
        // Durable with the host at once: a host killed while this waits adopts it.
        if let Err(err) = ctx.claim_instance_id(&id) {
            ec2.terminate_logged(&id, "its id could not be claimed");
            return Err(failed(err));
        }
        let running = match wait_running(&ec2, ctx, &id) {
            Ok(running) => running,
            Err(err) => {
                ec2.terminate_logged(&id, err.message());
                return Err(failed(err));
            }
        };
        // A status the host cannot take no longer undoes a running, claimed instance.
        let _ = ctx.set_status(InstanceStatus::Running, &format!("instance {id} is running"), &[]);
        let known = chosen.known;
        Ok(StartInstanceResult {
            display_name: name,
            instance: instance_of(&running),
            config: vec![("region".into(), ec2.config.region.clone()), ("image-id".into(), image)],
            hardware: Some(HardwareCharacteristics {
                arch: running.arch().map(str::to_owned).or(Some(chosen.arch.clone())),
                mem: known.map(|t| t.mem),
                root_disk: Some(select::root_disk_gib(root_disk) * 1024),
                root_disk_source: Some("ebs".into()),
                cpu_cores: known.map(|t| t.cores),
                cpu_power: known.map(|t| t.cpu_power),
                tags: None,
                availability_zone: Some(if running.zone.is_empty() { zone } else { running.zone.clone() }),
                virt_type: Some("hvm".into()),
            }),
            network_info: params.network_info.clone(),
            volumes: Vec::new(),
            volume_attachments: Vec::new(),
        })
    }

    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        let ec2 = Ec2::new(config(ctx)?);
        // Only instances that carry this namespace's tag; the rest are not ours (or gone).
        let live: Vec<String> = ec2.ours(&ids)?.into_iter().filter(|i| i.state != "terminated").map(|i| i.id).collect();
        for chunk in live.chunks(client::MAX_IDS_PER_CALL) {
            ec2.terminate(chunk)?;
        }
        Ok(())
    }

    /// The namespace's instances, described at once; the page is cut from that.
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError> {
        let ec2 = Ec2::new(config(ctx)?);
        Ok(broker_guest::listing::page_of(ec2.all()?.iter().map(listed_of).collect(), &page))
    }

    fn maintain_instance(ctx: &CallContext, id: String, params: StartInstanceParams) -> Result<(), BrokerError> {
        let ec2 = Ec2::new(config(ctx)?);
        let found = (ec2.ours(std::slice::from_ref(&id)).map_err(BrokerError::from)?.into_iter().next())
            .filter(|i| i.state != "terminated")
            .ok_or_else(|| BrokerError::NotFound(format!("no instance {id} of namespace {}", ec2.config.namespace)))?;
        let name = found.tag("Name").unwrap_or(&id).to_owned();
        let wanted_tags = params.instance_config.as_ref().map(|ic| ic.tags.as_slice()).unwrap_or_default();
        let wanted = query::instance_tags((&ec2.config.tag_key, &ec2.config.namespace), &name, wanted_tags)
            .map_err(BrokerError::InvalidParams)?;
        let drift: Vec<(String, String)> =
            wanted.into_iter().filter(|(k, v)| found.tag(k) != Some(v.as_str())).collect();
        if drift.is_empty() {
            return Ok(());
        }
        let keys: Vec<&str> = drift.iter().map(|(k, _)| k.as_str()).collect();
        host_log::log(host_log::Level::Info, &format!("instance {id}: re-tagging {keys:?}"));
        ec2.call(&query::create_tags(&id, &drift))?;
        Ok(())
    }
}

broker_guest::export_provider!(Ec2Provider);
