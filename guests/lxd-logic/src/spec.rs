//! What to ask LXD for: names, and the container spec Juju's LXD broker sends
//! (`POST /1.0/instances`): image alias, profiles, bridged NICs, cloud-init
//! config and limits from the constraints.

use crate::{Config, LxdError};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// The constraints this provider acts on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Wanted {
    pub arch: Option<String>,
    pub cores: Option<u64>,
    /// MiB
    pub mem: Option<u64>,
    /// MiB
    pub root_disk: Option<u64>,
    pub virt_type: Option<String>,
}

/// A bridged NIC, as LXD's device config has it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Nic {
    /// Device name in the container's config (`eth0`, …).
    pub device: String,
    pub parent: String,
    /// Empty: LXD picks one (reported back as `volatile.<device>.hwaddr`).
    pub hwaddr: String,
    pub mtu: u32,
}

/// Everything `POST /1.0/instances` carries.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerSpec {
    pub name: String,
    pub alias: String,
    /// LXD's architecture name, when the constraints name one.
    pub architecture: Option<String>,
    pub profiles: Vec<String>,
    pub devices: BTreeMap<String, BTreeMap<String, String>>,
    pub config: BTreeMap<String, String>,
}

/// `juju-<namespace>-`: the names this host owns.
pub fn prefix(config: &Config) -> String {
    format!("juju-{}-", config.namespace)
}

/// Juju's container name: `juju-<namespace>-<machine id>` (`/` becomes `-`),
/// or a sequence number when the call names no machine.
pub fn container_name(config: &Config, machine_id: Option<&str>, seq: u64) -> Result<String, LxdError> {
    let suffix = match machine_id.filter(|m| !m.is_empty()) {
        Some(machine) => machine.replace('/', "-"),
        None => seq.to_string(),
    };
    let name = format!("{}{suffix}", prefix(config));
    let ok = name.len() <= 63
        && suffix.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        && !name.ends_with('-')
        && !name.contains("--");
    if !ok {
        return Err(LxdError::InvalidParams(format!(
            "machine id {suffix:?} does not make a valid container name ({name:?}: at most 63 letters, digits and single '-')"
        )));
    }
    Ok(name.to_ascii_lowercase())
}

/// Juju's architecture names to LXD's, and back.
const ARCHES: &[(&str, &str)] =
    &[("amd64", "x86_64"), ("arm64", "aarch64"), ("ppc64el", "ppc64le"), ("s390x", "s390x"), ("riscv64", "riscv64")];

pub fn lxd_arch(juju: &str) -> Option<&'static str> {
    ARCHES.iter().find(|(j, _)| *j == juju).map(|(_, l)| *l)
}

pub fn juju_arch(lxd: &str) -> Option<&'static str> {
    ARCHES.iter().find(|(_, l)| *l == lxd).map(|(j, _)| *j)
}

/// What one container gets besides its NICs.
pub struct Request<'a> {
    pub name: String,
    pub alias: String,
    pub wanted: &'a Wanted,
    pub nics: &'a [Nic],
    pub user_data: Option<String>,
    pub network_config: Option<String>,
    pub charm_profiles: &'a [String],
    /// The instance config's tags: each becomes config key `user.<tag>`, as
    /// Juju's LXD provider keeps its tags (a group's `infrakit.*` among them).
    pub tags: &'a [(String, String)],
}

/// Whether `key` can be an LXD `user.` config key: letters, digits, `.`, `-`,
/// `_`, at most 128 bytes, and none of the keys this provider writes itself.
fn tag_key_ok(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 128
        && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        && !matches!(key, "user-data" | "network-config")
}

pub fn container_spec(config: &Config, request: Request<'_>) -> Result<ContainerSpec, LxdError> {
    let wanted = request.wanted;
    if let Some(virt) = wanted.virt_type.as_deref().filter(|v| !matches!(*v, "container" | "lxd")) {
        return Err(LxdError::InvalidParams(format!(
            "virt-type {virt:?} cannot be met: this provider makes containers"
        )));
    }
    let architecture = match wanted.arch.as_deref() {
        None => None,
        Some(arch) => Some(
            lxd_arch(arch)
                .ok_or_else(|| LxdError::InvalidParams(format!("architecture {arch:?} is not one LXD knows")))?
                .to_owned(),
        ),
    };
    if wanted.cores == Some(0) || wanted.mem == Some(0) || wanted.root_disk == Some(0) {
        return Err(LxdError::InvalidParams("cores, mem and root-disk must be positive when given".into()));
    }
    let mut config_keys = BTreeMap::new();
    config_keys.insert("boot.autostart".to_owned(), "true".to_owned());
    if let Some(cores) = wanted.cores {
        config_keys.insert("limits.cpu".to_owned(), cores.to_string());
    }
    if let Some(mem) = wanted.mem {
        config_keys.insert("limits.memory".to_owned(), format!("{mem}MiB"));
    }
    if let Some(user_data) = request.user_data {
        config_keys.insert("user.user-data".to_owned(), user_data);
    }
    if let Some(network) = request.network_config {
        config_keys.insert("user.network-config".to_owned(), network);
    }
    for (key, value) in request.tags {
        if !tag_key_ok(key) {
            return Err(LxdError::InvalidParams(format!(
                "tag {key:?} cannot be an LXD config key (user.<tag>: letters, digits, '.', '-', '_', at most 128 bytes)"
            )));
        }
        config_keys.insert(format!("user.{key}"), value.clone());
    }

    let mut devices = BTreeMap::new();
    for nic in request.nics {
        let mut device = BTreeMap::from([
            ("type".to_owned(), "nic".to_owned()),
            ("nictype".to_owned(), "bridged".to_owned()),
            ("parent".to_owned(), nic.parent.clone()),
            ("name".to_owned(), nic.device.clone()),
        ]);
        if !nic.hwaddr.is_empty() {
            device.insert("hwaddr".to_owned(), nic.hwaddr.clone());
        }
        if nic.mtu != 0 {
            device.insert("mtu".to_owned(), nic.mtu.to_string());
        }
        if devices.insert(nic.device.clone(), device).is_some() {
            return Err(LxdError::InvalidParams(format!("two network interfaces are both named {:?}", nic.device)));
        }
    }
    if let Some(size) = wanted.root_disk {
        devices.insert(
            "root".to_owned(),
            BTreeMap::from([
                ("type".to_owned(), "disk".to_owned()),
                ("path".to_owned(), "/".to_owned()),
                ("pool".to_owned(), config.storage_pool.clone()),
                ("size".to_owned(), format!("{size}MiB")),
            ]),
        );
    }
    let mut profiles = vec![config.profile.clone()];
    for profile in request.charm_profiles {
        if profile.is_empty() {
            return Err(LxdError::InvalidParams("cannot write charm profile: a profile has no name".into()));
        }
        if !profiles.contains(profile) {
            profiles.push(profile.clone());
        }
    }
    Ok(ContainerSpec { name: request.name, alias: request.alias, architecture, profiles, devices, config: config_keys })
}

impl ContainerSpec {
    /// The body of `POST /1.0/instances`.
    pub fn create_body(&self) -> Value {
        let mut body = json!({
            "name": self.name,
            "type": "container",
            "source": { "type": "image", "alias": self.alias },
            "profiles": self.profiles,
            "devices": self.devices,
            "config": self.config,
        });
        if let Some(arch) = &self.architecture {
            body["architecture"] = json!(arch);
        }
        body
    }

    /// How an existing instance differs from this spec (empty: it matches),
    /// for Juju's rule that "already exists" is fine only for the same spec.
    pub fn differences(&self, existing: &Value) -> Vec<String> {
        let mut out = Vec::new();
        let empty = Map::new();
        let config = existing["config"].as_object().unwrap_or(&empty);
        for (key, want) in &self.config {
            let have = config.get(key).and_then(Value::as_str);
            if have != Some(want.as_str()) {
                out.push(format!("config {key} is {have:?}, not {want:?}"));
            }
        }
        let profiles: Vec<&str> =
            existing["profiles"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        if profiles != self.profiles.iter().map(String::as_str).collect::<Vec<_>>() {
            out.push(format!("profiles are {profiles:?}, not {:?}", self.profiles));
        }
        let devices = existing["devices"].as_object().unwrap_or(&empty);
        for (name, device) in &self.devices {
            for (key, want) in device {
                let have = devices.get(name).and_then(|d| d.get(key)).and_then(Value::as_str);
                if have != Some(want.as_str()) {
                    out.push(format!("device {name} {key} is {have:?}, not {want:?}"));
                }
            }
        }
        if let Some(arch) = &self.architecture
            && existing["architecture"].as_str() != Some(arch.as_str())
        {
            out.push(format!("architecture is {:?}, not {arch:?}", existing["architecture"]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::parse(r#"{"namespace":"host0","storage-pool":"fast"}"#).unwrap()
    }

    fn nic() -> Nic {
        Nic { device: "eth0".into(), parent: "br-eth0".into(), hwaddr: "00:16:3e:00:00:01".into(), mtu: 1400 }
    }

    fn request<'a>(wanted: &'a Wanted, nics: &'a [Nic], profiles: &'a [String]) -> Request<'a> {
        Request {
            name: "juju-host0-3".into(),
            alias: "busybox".into(),
            wanted,
            nics,
            user_data: Some("#cloud-config\n".into()),
            network_config: Some("{}".into()),
            charm_profiles: profiles,
            tags: &[],
        }
    }

    #[test]
    fn names_follow_juju_and_stay_hostnames() {
        let c = config();
        assert_eq!(container_name(&c, Some("3"), 9).unwrap(), "juju-host0-3");
        assert_eq!(container_name(&c, Some("0/lxd/2"), 9).unwrap(), "juju-host0-0-lxd-2");
        assert_eq!(container_name(&c, None, 9).unwrap(), "juju-host0-9");
        assert!(container_name(&c, Some("a b"), 0).is_err());
        assert!(container_name(&c, Some(&"9".repeat(60)), 0).is_err());
        assert_eq!(prefix(&c), "juju-host0-");
    }

    #[test]
    fn the_spec_carries_limits_nics_cloud_init_and_profiles() {
        let wanted = Wanted {
            arch: Some("amd64".into()),
            cores: Some(2),
            mem: Some(256),
            root_disk: Some(1024),
            ..Wanted::default()
        };
        let nics = [nic()];
        let profiles = ["juju-app".to_owned()];
        let spec = container_spec(&config(), request(&wanted, &nics, &profiles)).unwrap();
        let body = spec.create_body();
        assert_eq!(body["source"], json!({"type": "image", "alias": "busybox"}));
        assert_eq!(body["architecture"], "x86_64");
        assert_eq!(body["profiles"], json!(["default", "juju-app"]));
        assert_eq!(body["config"]["limits.cpu"], "2");
        assert_eq!(body["config"]["limits.memory"], "256MiB");
        assert_eq!(body["config"]["boot.autostart"], "true");
        assert_eq!(body["config"]["user.user-data"], "#cloud-config\n");
        let tags = [("infrakit.group".to_owned(), "workers".to_owned())];
        let tagged = container_spec(&config(), Request { tags: &tags, ..request(&wanted, &nics, &profiles) }).unwrap();
        assert_eq!(tagged.create_body()["config"]["user.infrakit.group"], "workers");
        for bad in ["user-data", "a b", "", "x\n"] {
            let tags = [(bad.to_owned(), "v".to_owned())];
            let refused = container_spec(&config(), Request { tags: &tags, ..request(&wanted, &nics, &profiles) });
            assert!(refused.is_err(), "{bad:?}");
        }
        assert_eq!(body["devices"]["eth0"]["nictype"], "bridged");
        assert_eq!(body["devices"]["eth0"]["parent"], "br-eth0");
        assert_eq!(body["devices"]["eth0"]["hwaddr"], "00:16:3e:00:00:01");
        assert_eq!(body["devices"]["eth0"]["mtu"], "1400");
        assert_eq!(body["devices"]["root"]["pool"], "fast");
        assert_eq!(body["devices"]["root"]["size"], "1024MiB");

        let plain = container_spec(&config(), request(&Wanted::default(), &[], &[])).unwrap().create_body();
        assert!(plain.get("architecture").is_none() && plain["config"].get("limits.cpu").is_none());
        assert!(plain["devices"].as_object().unwrap().is_empty());
    }

    #[test]
    fn impossible_requests_are_refused_before_anything_is_made() {
        let c = config();
        let vm = Wanted { virt_type: Some("kvm".into()), ..Wanted::default() };
        assert!(container_spec(&c, request(&vm, &[], &[])).unwrap_err().to_string().contains("virt-type"));
        let arch = Wanted { arch: Some("sparc".into()), ..Wanted::default() };
        assert!(container_spec(&c, request(&arch, &[], &[])).unwrap_err().to_string().contains("sparc"));
        let nameless = ["".to_owned()];
        let err = container_spec(&c, request(&Wanted::default(), &[], &nameless)).unwrap_err().to_string();
        assert!(err.starts_with("cannot write charm profile"), "{err}");
        let twice = [nic(), nic()];
        assert!(container_spec(&c, request(&Wanted::default(), &twice, &[])).is_err());
    }

    #[test]
    fn an_existing_instance_matches_only_the_same_spec() {
        let wanted = Wanted { cores: Some(1), ..Wanted::default() };
        let nics = [nic()];
        let spec = container_spec(&config(), request(&wanted, &nics, &[])).unwrap();
        let mut existing = spec.create_body();
        existing["config"]["volatile.eth0.hwaddr"] = json!("00:16:3e:00:00:01");
        assert!(spec.differences(&existing).is_empty());
        existing["config"]["limits.cpu"] = json!("4");
        existing["devices"]["eth0"]["parent"] = json!("lxdbr0");
        let diff = spec.differences(&existing);
        assert_eq!(diff.len(), 2, "{diff:?}");
        assert!(diff[0].contains("limits.cpu") && diff[1].contains("parent"), "{diff:?}");
    }
}
