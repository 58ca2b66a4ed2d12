//! A provider that breaks one scenario of `broker provider test` on purpose
//! and is the fake otherwise. Its config key `breaks` names the scenario; the
//! kit's own tests run it once per scenario and expect that case to fail.
//!
//! `validate-config` sees only the text it is given, so the break is also
//! kept in kv when the real config is validated, for the garbage that follows.

use crate::fake::{self, Fake, HostKv};
use broker_guest::types::{
    BrokerError, Instance, InstancePage, InstanceStatus, PageRequest, ProviderInfo, StartInstanceParams,
    StartInstanceResult,
};
use broker_guest::{CallContext, Guest, host_kv, machine_lock, network_bridge, process};

pub struct Broken;

const BREAKS_KEY: &str = "broken/breaks";

/// The scenario a config breaks, and the fake's config without the key.
fn split(config: &str) -> Result<(String, fake_logic::Config), BrokerError> {
    let mut value: serde_json::Value =
        serde_json::from_str(config).map_err(|e| BrokerError::InvalidParams(format!("config is not JSON: {e}")))?;
    let breaks = value
        .as_object_mut()
        .and_then(|fields| fields.remove("breaks"))
        .and_then(|b| b.as_str().map(str::to_owned))
        .unwrap_or_default();
    let config = fake_logic::Config::parse(&value.to_string()).map_err(fake::to_broker_error)?;
    Ok((breaks, config))
}

fn breaks(ctx: &CallContext) -> String {
    split(&ctx.provider_config()).map(|(breaks, _)| breaks).unwrap_or_default()
}

impl Guest for Broken {
    fn describe() -> ProviderInfo {
        let mut info = Fake::describe();
        info.name = "broken".into();
        if crate::BREAKS_DESCRIBE {
            info.version.clear();
        }
        info
    }

    fn validate_config(text: String) -> Result<(), BrokerError> {
        if let Ok((breaks, _)) = split(&text) {
            host_kv::set(BREAKS_KEY, breaks.as_bytes())?;
            if breaks == "accepts-config" {
                return Err(BrokerError::InvalidParams("this build refuses every config".into()));
            }
            return Ok(());
        }
        if host_kv::get(BREAKS_KEY)?.is_some_and(|b| b == b"rejects-garbage") {
            return Ok(());
        }
        split(&text).map(drop)
    }

    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        let (breaks, config) = split(&ctx.provider_config())?;
        ctx.set_status(InstanceStatus::Allocating, "allocating instance", &[])?;
        if breaks == "start" && params.constraints.cores.is_some() {
            return Err(BrokerError::Provider("this build cannot start an instance with a cores constraint".into()));
        }
        if breaks == "status" {
            ctx.set_status(InstanceStatus::Error, "a transient error, reported anyway", &[])?;
        }
        let group = if breaks == "zones" { Vec::new() } else { ctx.distribution_group()? };
        let mut request = fake::request(&params, group);
        // Ignores a placement in a zone it has (one it does not have is still refused).
        let zone = params.placement.as_deref().and_then(|p| p.strip_prefix("zone="));
        if breaks == "placement" && zone.is_some_and(|zone| config.zones.iter().any(|z| z == zone)) {
            request.placement = None;
        }
        let started = fake_logic::start(&HostKv, &config, request).map_err(|e| {
            match (breaks.as_str(), fake::to_broker_error(e)) {
                ("typed-errors", error) => BrokerError::Provider(format!("{error:?}")),
                (_, error) => error,
            }
        })?;
        ctx.set_status(InstanceStatus::Running, "", &[])?;
        let mut hardware = fake::hardware(&started.hardware);
        if breaks == "hardware" {
            hardware.cpu_cores = Some(1);
        }
        let mut instance = fake::instance(&started);
        if breaks == "bad-id" && params.constraints.cores.is_some() {
            // A terminal escape in the id: a title change for whoever lists it.
            instance.id.push_str("\u{1b}]0;owned\u{7}");
        }
        Ok(StartInstanceResult {
            display_name: started.id.clone(),
            instance,
            config: Vec::new(),
            hardware: Some(hardware),
            network_info: params.network_info,
            volumes: Vec::new(),
            volume_attachments: Vec::new(),
        })
    }

    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        let breaks = breaks(ctx);
        let running = fake_logic::all(&HostKv).map_err(fake::to_broker_error)?;
        for id in &ids {
            let stopped_before = host_kv::get(&format!("broken/stopped/{id}"))?.is_some();
            let never_seen = !stopped_before && !running.iter().any(|i| &i.id == id);
            if (breaks == "double-stop" && stopped_before) || (breaks == "unknown-stop" && never_seen) {
                return Err(BrokerError::NotFound(format!("no instance {id}")));
            }
        }
        if breaks == "stop" {
            return Ok(());
        }
        fake_logic::stop(&HostKv, &ids).map_err(fake::to_broker_error)?;
        for id in &ids {
            host_kv::set(&format!("broken/stopped/{id}"), b"")?;
        }
        Ok(())
    }

    /// Its whole listing, cut into the page asked for.
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError> {
        let all = Self::whole_listing(ctx)?.into_iter().map(broker_guest::listing::listed).collect();
        Ok(broker_guest::listing::page_of(all, &page))
    }

    fn maintain_instance(ctx: &CallContext, id: String, params: StartInstanceParams) -> Result<(), BrokerError> {
        match breaks(ctx).as_str() {
            "maintain" => Err(BrokerError::NotFound(format!("{id} is not mine (it is)"))),
            "deadline" => loop {
                std::hint::black_box(&id);
            },
            _ => Fake::maintain_instance(ctx, id, params),
        }
    }
}

impl Broken {
    /// Every instance it lists, as one answer.
    fn whole_listing(ctx: &CallContext) -> Result<Vec<Instance>, BrokerError> {
        let breaks = breaks(ctx);
        if breaks == "ungranted" {
            // Not granted: the host refuses, and this build carries on as if nothing happened.
            let _ = machine_lock::acquire("broken", "reaching for what it was not granted", 10);
        }
        if breaks == "anothers-device" {
            // Granted by name, made by another provider: refused, and this
            // build carries on regardless (its own tap it may still make).
            let _ = network_bridge::attach("kt-other", "br-mine");
            let _ = network_bridge::delete_link("kt-other");
            let _ = network_bridge::unbridge("kt-mine", "br-host");
            let _ = network_bridge::create_tap("kt-mine", "br-host", "");
        }
        if breaks == "ungranted-process" {
            let _ = process::run("sh", &["-c".into(), "id".into()], &[], &[], 0);
        }
        // With `true` granted: a loader variable, and a host path as an argument.
        // Both refused before anything runs; this build carries on regardless.
        if breaks == "loader-env" {
            let _ = process::run("true", &[], &[("LD_PRELOAD".into(), "/data/evil.so".into())], &[], 1000);
        }
        if breaks == "host-path" {
            let _ = process::run("true", &["/etc/shadow".into()], &[], &[], 1000);
        }
        if breaks == "symlink" {
            // A link out of /data: refused, and this build carries on as if nothing happened.
            #[allow(deprecated)] // the portable spelling; std's wasi symlink is unstable
            let _ = std::fs::soft_link("../../../etc/hostname", "/data/escape");
        }
        if breaks == "listed" {
            return Ok(Vec::new());
        }
        let all: Vec<Instance> =
            fake_logic::all(&HostKv).map_err(fake::to_broker_error)?.iter().map(fake::instance).collect();
        if breaks == "takes-over" && all.is_empty() {
            // Someone's live instance, under the id this build's first start will answer with.
            let live = Instance {
                id: "fake-0".into(),
                status: InstanceStatus::Running,
                message: String::new(),
                addresses: Vec::new(),
            };
            return Ok(vec![live]);
        }
        Ok(all)
    }
}
