//! The commands the provider runs: the overlay, the NoCloud seed, qemu itself.

use crate::config::{Accel, Config};
use crate::spec::{Boot, Nic, Size, VmPaths};
use serde_json::json;

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// `qemu-img create`: an overlay on the base image, or a blank disk.
pub fn root_disk_args(config: &Config, boot: &Boot, size: &Size, paths: &VmPaths) -> Vec<String> {
    let mut args = strings(&["create", "-q", "-f", "qcow2"]);
    if let Some(base) = &boot.base_image {
        args.extend(["-F".into(), config.base_format.clone(), "-b".into(), base.clone()]);
    }
    args.extend([paths.root_disk.clone(), format!("{}M", size.root_disk)]);
    args
}

/// The seed files, name -> content. `meta-data` and `network-config` are JSON,
/// which cloud-init reads as YAML.
pub struct Seed {
    pub files: Vec<(&'static str, Vec<u8>)>,
}

/// `network` is the netplan document (`broker_guest::netplan::network_config`).
pub fn seed(name: &str, user_data: Option<&[u8]>, network: &serde_json::Value) -> Seed {
    let meta = json!({ "instance-id": name, "local-hostname": name });
    let user = user_data.map(<[u8]>::to_vec).unwrap_or_else(|| b"#cloud-config\n{}\n".to_vec());
    Seed {
        files: vec![
            ("user-data", user),
            ("meta-data", meta.to_string().into_bytes()),
            ("network-config", network.to_string().into_bytes()),
        ],
    }
}

/// `genisoimage`: volume id `cidata`, as NoCloud wants.
pub fn seed_iso_args(paths: &VmPaths, seed: &Seed) -> Vec<String> {
    let mut args = strings(&["-quiet", "-output"]);
    args.push(paths.seed_iso.clone());
    args.extend(strings(&["-volid", "cidata", "-joliet", "-rock"]));
    args.extend(seed.files.iter().map(|(file, _)| format!("{}/{file}", paths.seed_dir)));
    args
}

/// The full qemu command line (without the program).
pub fn qemu_args(config: &Config, name: &str, boot: &Boot, size: &Size, paths: &VmPaths, nics: &[Nic]) -> Vec<String> {
    let mut args = strings(&["-name", name, "-machine", "pc", "-nodefaults", "-no-user-config", "-display", "none"]);
    match config.accel {
        // KVM if it opens, else TCG; `max` is the host CPU under KVM.
        Accel::Auto => args.extend(strings(&["-accel", "kvm", "-accel", "tcg", "-cpu", "max"])),
        Accel::Kvm => args.extend(strings(&["-accel", "kvm", "-cpu", "host"])),
        Accel::Tcg => args.extend(strings(&["-accel", "tcg", "-cpu", "max"])),
    }
    args.extend(["-m".into(), size.mem.to_string(), "-smp".into(), size.cores.to_string()]);
    args.extend(["-serial".into(), format!("file:{}", paths.console)]);
    args.extend(["-qmp".into(), format!("unix:{},server=on,wait=off", paths.qmp)]);
    args.extend(["-drive".into(), format!("file={},if=virtio,format=qcow2", paths.root_disk)]);
    args.extend(["-drive".into(), format!("file={},if=virtio,format=raw,readonly=on", paths.seed_iso)]);
    if let Some(kernel) = &boot.kernel {
        args.extend(["-kernel".into(), kernel.clone()]);
        if let Some(initrd) = &boot.initrd {
            args.extend(["-initrd".into(), initrd.clone()]);
        }
        args.extend(["-append".into(), boot.append.clone().unwrap_or_else(|| "console=ttyS0".into())]);
    }
    for (i, nic) in nics.iter().enumerate() {
        args.extend(["-netdev".into(), format!("tap,id=net{i},ifname={},script=no,downscript=no", nic.tap)]);
        args.extend(["-device".into(), format!("virtio-net-pci,netdev=net{i},mac={}", nic.mac)]);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::paths;
    use serde_json::Value;

    #[test]
    fn qemu_gets_what_was_decided() {
        let config = Config::parse(r#"{"namespace":"t","accel":"tcg"}"#).unwrap();
        let boot = Boot { kernel: Some("/img/vmlinuz".into()), initrd: Some("/img/initrd".into()), ..Boot::default() };
        let size = Size { mem: 768, cores: 2, root_disk: 2048 };
        let p = paths("juju-t-0", 3);
        let nics = vec![Nic { tap: "kt1n0".into(), bridge: "br-x".into(), mac: "52:54:00:00:00:01".into() }];
        let args = qemu_args(&config, "juju-t-0", &boot, &size, &p, &nics).join(" ");
        for part in [
            "-accel tcg",
            "-m 768 -smp 2",
            "-serial file:/data/vm/juju-t-0/console.log",
            "-qmp unix:/data/run/3.qmp,server=on,wait=off",
            "-kernel /img/vmlinuz -initrd /img/initrd -append console=ttyS0",
            "tap,id=net0,ifname=kt1n0,script=no,downscript=no",
            "virtio-net-pci,netdev=net0,mac=52:54:00:00:00:01",
        ] {
            assert!(args.contains(part), "{part} missing from {args}");
        }
        let disk = root_disk_args(&config, &boot, &size, &p).join(" ");
        assert_eq!(disk, "create -q -f qcow2 /data/vm/juju-t-0/root.qcow2 2048M");
        let based = Boot { base_image: Some("/img/base.qcow2".into()), ..Boot::default() };
        assert!(root_disk_args(&config, &based, &size, &p).join(" ").contains("-F qcow2 -b /img/base.qcow2"));
    }

    #[test]
    fn seed_carries_identity_user_data_and_network() {
        let network = json!({"version": 2, "ethernets": {"eth0": {
            "match": {"macaddress": "52:54:00:00:00:01"}, "set-name": "eth0",
            "routes": [{"to": "default", "via": "10.1.0.1"}], "mtu": 1400}}});
        let seed = seed("juju-t-0", Some(b"#cloud-config\nhostname: x\n"), &network);
        let file = |n: &str| seed.files.iter().find(|(f, _)| *f == n).map(|(_, c)| c.clone()).unwrap();
        let meta: Value = serde_json::from_slice(&file("meta-data")).unwrap();
        assert_eq!(meta["instance-id"], "juju-t-0");
        let net: Value = serde_json::from_slice(&file("network-config")).unwrap();
        assert_eq!(net["ethernets"]["eth0"]["match"]["macaddress"], "52:54:00:00:00:01");
        assert_eq!(net["ethernets"]["eth0"]["routes"][0]["via"], "10.1.0.1");
        assert_eq!(net["ethernets"]["eth0"]["mtu"], 1400);
        assert_eq!(file("user-data"), b"#cloud-config\nhostname: x\n");
        let p = paths("juju-t-0", 3);
        let iso = seed_iso_args(&p, &seed).join(" ");
        assert!(iso.contains("-volid cidata") && iso.ends_with("/data/vm/juju-t-0/seed/network-config"), "{iso}");
    }
}
