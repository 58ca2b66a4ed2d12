//! What one VM will be: Juju's KVM sizing rules applied to the constraints,
//! its boot source, its names and its NICs.

use crate::KvmError;
use crate::config::Config;
use serde::{Deserialize, Serialize};

/// Juju's KVM defaults and minimums, MiB.
pub const DEFAULT_MEM: u64 = 512;
pub const MIN_MEM: u64 = 512;
pub const DEFAULT_CORES: u64 = 1;
pub const DEFAULT_ROOT_DISK: u64 = 8 * 1024;
pub const MIN_ROOT_DISK: u64 = 2 * 1024;

/// The constraints the provider reads (a plain copy of the WIT record's fields).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Wanted {
    pub arch: Option<String>,
    pub mem: Option<u64>,
    pub cores: Option<u64>,
    pub root_disk: Option<u64>,
    pub virt_type: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    pub mem: u64,
    pub cores: u64,
    pub root_disk: u64,
}

/// Juju's rules: defaults where unconstrained, minimums raised to, and a clear
/// refusal for what this host cannot give.
pub fn size(config: &Config, wanted: &Wanted) -> Result<Size, KvmError> {
    if let Some(arch) = wanted.arch.as_deref().filter(|a| *a != "amd64") {
        return Err(KvmError::InvalidParams(format!("arch={arch} cannot be met: this host runs amd64 VMs only")));
    }
    if let Some(virt) = wanted.virt_type.as_deref().filter(|v| *v != "kvm") {
        return Err(KvmError::InvalidParams(format!("virt-type={virt} cannot be met: this provider makes kvm VMs")));
    }
    let mem = wanted.mem.unwrap_or(DEFAULT_MEM).max(MIN_MEM);
    let cores = wanted.cores.unwrap_or(DEFAULT_CORES).max(1);
    let root_disk = wanted.root_disk.unwrap_or(DEFAULT_ROOT_DISK).max(MIN_ROOT_DISK);
    let over = |what: &str, asked: u64, limit: u64, key: &str| {
        KvmError::InvalidParams(format!(
            "{what}={asked} cannot be met: this host gives a VM at most {limit} (provider config {key})"
        ))
    };
    if mem > config.max_mem {
        return Err(over("mem", mem, config.max_mem, "max-mem"));
    }
    if cores > config.max_cores {
        return Err(over("cores", cores, config.max_cores, "max-cores"));
    }
    if root_disk > config.max_root_disk {
        return Err(over("root-disk", root_disk, config.max_root_disk, "max-root-disk"));
    }
    Ok(Size { mem, cores, root_disk })
}

/// What the VM boots from. Image metadata (`extra`: `base-image`, `kernel`,
/// `initrd`, `append`) wins over the provider config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Boot {
    pub base_image: Option<String>,
    pub kernel: Option<String>,
    pub initrd: Option<String>,
    pub append: Option<String>,
}

pub fn boot(config: &Config, image_extra: &[(String, String)]) -> Result<Boot, KvmError> {
    let from_image = |key: &str| image_extra.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let boot = Boot {
        base_image: from_image("base-image").or_else(|| config.base_image.clone()),
        kernel: from_image("kernel").or_else(|| config.kernel.clone()),
        initrd: from_image("initrd").or_else(|| config.initrd.clone()),
        append: from_image("append").or_else(|| config.append.clone()),
    };
    if boot.base_image.is_none() && boot.kernel.is_none() {
        return Err(KvmError::InvalidParams(
            "no image to boot: give base-image or kernel in the image metadata or the provider config".into(),
        ));
    }
    for path in [&boot.base_image, &boot.kernel, &boot.initrd].into_iter().flatten() {
        if !path.starts_with('/') || path.split('/').any(|p| p == "..") {
            return Err(KvmError::InvalidParams(format!("image path {path:?} must be absolute without '..'")));
        }
    }
    Ok(boot)
}

/// The VM's name (its instance id, hostname and child name): Juju's
/// `juju-<namespace>-<machine>`, the machine id's `/` made `-`
/// (`0/kvm/1` -> `juju-ns-0-kvm-1`); `vm<seq>` when no machine id is given.
pub fn vm_name(config: &Config, machine_id: Option<&str>, seq: u64) -> Result<String, KvmError> {
    let machine = match machine_id.filter(|m| !m.is_empty()) {
        Some(m) => {
            if !m.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '-')) {
                return Err(KvmError::InvalidParams(format!("machine id {m:?} has characters a VM name cannot")));
            }
            m.replace('/', "-").to_ascii_lowercase()
        }
        None => format!("vm{seq}"),
    };
    let name = format!("{}{machine}", prefix(config));
    if name.len() > 64 {
        return Err(KvmError::InvalidParams(format!("VM name {name:?} is longer than 64 characters")));
    }
    Ok(name)
}

/// Names of this host's VMs start with this.
pub fn prefix(config: &Config) -> String {
    format!("juju-{}-", config.namespace)
}

/// A tap name (at most 15 characters): `kt`, 4 hex digits of the namespace,
/// the VM's sequence number, `n`, the NIC index. Two hosts' taps differ by namespace.
pub fn tap_name(config: &Config, seq: u64, nic: usize) -> String {
    let hash = fnv1a(config.namespace.bytes());
    format!("kt{:04x}{}n{nic}", hash & 0xffff, seq % 100_000)
}

/// A stable locally administered MAC (qemu's `52:54:00` prefix) for a NIC the
/// network info left without one.
pub fn generated_mac(name: &str, nic: usize) -> String {
    let h = fnv1a(name.bytes().chain([nic as u8]));
    format!("52:54:00:{:02x}:{:02x}:{:02x}", (h >> 16) as u8, (h >> 8) as u8, h as u8)
}

/// 32-bit FNV-1a: short, stable names and MACs from longer text.
fn fnv1a(bytes: impl Iterator<Item = u8>) -> u32 {
    bytes.fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// One NIC: a tap on a host bridge, with the MAC the network info gave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    pub tap: String,
    pub bridge: String,
    pub mac: String,
}

/// The host side of a VM's NIC gets the VM's MAC with the first octet `fe`, as
/// libvirt does: the same MAC on both ends would confuse the bridge, and `fe`
/// keeps the tap from being chosen as the bridge's own address.
pub fn tap_mac(vm_mac: &str) -> String {
    match vm_mac.split_once(':') {
        Some((_, rest)) => format!("fe:{rest}"),
        None => String::new(),
    }
}

/// What the provider keeps in kv for each VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmRecord {
    pub name: String,
    pub seq: u64,
    pub mem: u64,
    pub cores: u64,
    pub root_disk: u64,
    /// `kvm` or `qemu` (TCG), as qemu reported it.
    pub virt_type: String,
    pub nics: Vec<Nic>,
}

/// Key prefix of the VM records in kv.
pub const RECORD_PREFIX: &str = "vm/";

pub fn record_key(name: &str) -> String {
    format!("{RECORD_PREFIX}{name}")
}

/// The guest's paths for one VM's files.
pub struct VmPaths {
    pub dir: String,
    pub root_disk: String,
    pub seed_dir: String,
    pub seed_iso: String,
    pub console: String,
    /// Short, as qemu must bind it under the 108-byte socket path limit.
    pub qmp: String,
}

pub fn paths(name: &str, seq: u64) -> VmPaths {
    let dir = format!("/data/vm/{name}");
    VmPaths {
        root_disk: format!("{dir}/root.qcow2"),
        seed_dir: format!("{dir}/seed"),
        seed_iso: format!("{dir}/seed.iso"),
        console: format!("{dir}/console.log"),
        qmp: format!("/data/run/{seq}.qmp"),
        dir,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::parse(r#"{"namespace":"ns1","kernel":"/k","max-cores":4}"#).unwrap()
    }

    #[test]
    fn juju_defaults_minimums_and_limits() {
        let c = config();
        assert_eq!(size(&c, &Wanted::default()).unwrap(), Size { mem: 512, cores: 1, root_disk: 8192 });
        let small = Wanted { mem: Some(128), root_disk: Some(100), cores: Some(0), ..Wanted::default() };
        assert_eq!(size(&c, &small).unwrap(), Size { mem: 512, cores: 1, root_disk: 2048 }, "raised to minimums");
        let big = Wanted { mem: Some(1024), cores: Some(3), root_disk: Some(4096), ..Wanted::default() };
        assert_eq!(size(&c, &big).unwrap(), Size { mem: 1024, cores: 3, root_disk: 4096 });
        let too_many = size(&c, &Wanted { cores: Some(64), ..Wanted::default() }).unwrap_err();
        assert_eq!(
            too_many,
            KvmError::InvalidParams(
                "cores=64 cannot be met: this host gives a VM at most 4 (provider config max-cores)".into()
            )
        );
        assert!(size(&c, &Wanted { arch: Some("arm64".into()), ..Wanted::default() }).is_err());
        assert!(size(&c, &Wanted { virt_type: Some("lxd".into()), ..Wanted::default() }).is_err());
        assert!(size(&c, &Wanted { arch: Some("amd64".into()), ..Wanted::default() }).is_ok());
    }

    #[test]
    fn names_follow_juju_and_taps_fit_ifnamsiz() {
        let c = config();
        assert_eq!(vm_name(&c, Some("0/kvm/1"), 7).unwrap(), "juju-ns1-0-kvm-1");
        assert_eq!(vm_name(&c, None, 7).unwrap(), "juju-ns1-vm7");
        assert!(vm_name(&c, Some("0;rm"), 1).is_err());
        let tap = tap_name(&c, 99_999, 9);
        assert!(tap.len() <= 15, "{tap}");
        let other = Config { namespace: "ns2".into(), ..c.clone() };
        assert_ne!(tap_name(&c, 1, 0), tap_name(&other, 1, 0));
        assert_eq!(tap_mac("52:54:00:12:34:56"), "fe:54:00:12:34:56");
        assert_eq!(generated_mac("juju-ns1-vm7", 0), generated_mac("juju-ns1-vm7", 0));
        assert_ne!(generated_mac("juju-ns1-vm7", 0), generated_mac("juju-ns1-vm7", 1));
        assert!(generated_mac("juju-ns1-vm7", 0).starts_with("52:54:00:"));
    }

    #[test]
    fn image_metadata_wins_over_config() {
        let c = config();
        assert_eq!(boot(&c, &[]).unwrap().kernel.as_deref(), Some("/k"));
        let extra = vec![("kernel".to_owned(), "/other".to_owned()), ("append".to_owned(), "quiet".to_owned())];
        let b = boot(&c, &extra).unwrap();
        assert_eq!((b.kernel.as_deref(), b.append.as_deref()), (Some("/other"), Some("quiet")));
        let bare = Config { kernel: None, ..c };
        assert!(boot(&bare, &[]).is_err());
        assert!(boot(&bare, &[("base-image".into(), "../x".into())]).is_err());
    }
}
