//! What a start gets, as Juju's EC2 broker decides it: the cheapest instance
//! type that satisfies the constraints, the image for the region and
//! architecture, and the zone (placement, else the distribution group's
//! emptiest allowed zone, ties by name).

use crate::{Config, Ec2Error};
use std::collections::BTreeMap;

/// One instance type of the table below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceType {
    pub name: &'static str,
    pub arch: &'static str,
    pub cores: u64,
    /// MiB
    pub mem: u64,
    /// Juju's cpu-power: 100 per core.
    pub cpu_power: u64,
    /// On-demand price in millicents an hour (us-east-1, Linux): only the order matters.
    pub cost: u64,
}

const fn t(name: &'static str, arch: &'static str, cores: u64, mem_gib_tenths: u64, cost: u64) -> InstanceType {
    InstanceType { name, arch, cores, mem: mem_gib_tenths * 1024 / 10, cpu_power: cores * 100, cost }
}

/// The instance types a start may get, general-purpose and compute families.
/// An `instance-type` constraint may name any other type.
pub const INSTANCE_TYPES: &[InstanceType] = &[
    t("t3.nano", "amd64", 2, 5, 520),
    t("t3.micro", "amd64", 2, 10, 1040),
    t("t3.small", "amd64", 2, 20, 2080),
    t("t3.medium", "amd64", 2, 40, 4160),
    t("t3.large", "amd64", 2, 80, 8320),
    t("c5.large", "amd64", 2, 40, 8500),
    t("m5.large", "amd64", 2, 80, 9600),
    t("r5.large", "amd64", 2, 160, 12600),
    t("t3.xlarge", "amd64", 4, 160, 16640),
    t("c5.xlarge", "amd64", 4, 80, 17000),
    t("m5.xlarge", "amd64", 4, 160, 19200),
    t("c5.2xlarge", "amd64", 8, 160, 34000),
    t("m5.2xlarge", "amd64", 8, 320, 38400),
    t("m5.4xlarge", "amd64", 16, 640, 76800),
    t("t4g.nano", "arm64", 2, 5, 420),
    t("t4g.micro", "arm64", 2, 10, 840),
    t("t4g.small", "arm64", 2, 20, 1680),
    t("t4g.medium", "arm64", 2, 40, 3360),
    t("t4g.large", "arm64", 2, 80, 6720),
    t("m6g.large", "arm64", 2, 80, 7700),
    t("m6g.xlarge", "arm64", 4, 160, 15400),
    t("m6g.2xlarge", "arm64", 8, 320, 30800),
];

/// Juju's floor when no memory is asked for: 1 GiB.
pub const DEFAULT_MIN_MEM: u64 = 1024;
/// The root volume when no root-disk is asked for, GiB (Juju's 8 GiB).
pub const DEFAULT_ROOT_DISK_GIB: u64 = 8;

/// The constraints that choose an instance type.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    pub arch: Option<String>,
    pub cores: Option<u64>,
    pub cpu_power: Option<u64>,
    /// MiB
    pub mem: Option<u64>,
    pub instance_type: Option<String>,
}

/// The chosen type: from the table, or one named by the constraint that the table lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    pub name: String,
    pub arch: String,
    pub known: Option<InstanceType>,
}

fn normal_arch(arch: &str) -> Option<&'static str> {
    match arch {
        "amd64" | "x86_64" => Some("amd64"),
        "arm64" | "aarch64" => Some("arm64"),
        _ => None,
    }
}

/// The cheapest type that satisfies every constraint (ties by name); an
/// `instance-type` constraint wins, checked against the others when the table knows it.
pub fn instance_type(config: &Config, wanted: &Wanted) -> Result<Chosen, Ec2Error> {
    let arch = match &wanted.arch {
        None => config.default_arch.as_str(),
        Some(arch) => normal_arch(arch)
            .ok_or_else(|| Ec2Error::ZoneIndependent(format!("EC2 has no instances of architecture {arch:?}")))?,
    };
    if let Some(name) = &wanted.instance_type {
        let plain = !name.is_empty()
            && name.len() <= 32
            && name.split_once('.').is_some_and(|(family, size)| {
                [family, size].iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
            });
        if !plain {
            return Err(Ec2Error::InvalidParams(format!(
                "instance-type {name:?} is not an EC2 type name (family.size)"
            )));
        }
        let Some(known) = INSTANCE_TYPES.iter().find(|t| t.name == name) else {
            return Ok(Chosen { name: name.clone(), arch: arch.to_owned(), known: None });
        };
        if wanted.arch.is_some() && known.arch != arch {
            return Err(Ec2Error::ZoneIndependent(format!("instance-type {name} is {}, not {arch}", known.arch)));
        }
        let short: Vec<String> = shortfalls(known, wanted, 0);
        if !short.is_empty() {
            return Err(Ec2Error::ZoneIndependent(format!("instance-type {name} has {}", short.join(", "))));
        }
        return Ok(Chosen { name: name.clone(), arch: known.arch.to_owned(), known: Some(*known) });
    }
    let floor = if wanted.mem.is_none() { DEFAULT_MIN_MEM } else { 0 };
    INSTANCE_TYPES
        .iter()
        .filter(|t| t.arch == arch && shortfalls(t, wanted, floor).is_empty())
        .min_by(|a, b| a.cost.cmp(&b.cost).then(a.name.cmp(b.name)))
        .map(|t| Chosen { name: t.name.to_owned(), arch: t.arch.to_owned(), known: Some(*t) })
        .ok_or_else(|| {
            Ec2Error::ZoneIndependent(format!(
                "no instance type satisfies arch={arch}{}{}{}",
                wanted.cores.map(|c| format!(" cores={c}")).unwrap_or_default(),
                wanted.mem.map(|m| format!(" mem={m}M")).unwrap_or_default(),
                wanted.cpu_power.map(|p| format!(" cpu-power={p}")).unwrap_or_default(),
            ))
        })
}

/// What `t` lacks of `wanted` (memory at least `floor` MiB).
fn shortfalls(t: &InstanceType, wanted: &Wanted, floor: u64) -> Vec<String> {
    let mut short = Vec::new();
    if t.cores < wanted.cores.unwrap_or(0) {
        short.push(format!("{} cores, fewer than {}", t.cores, wanted.cores.unwrap_or(0)));
    }
    let mem = wanted.mem.unwrap_or(0).max(floor);
    if t.mem < mem {
        short.push(format!("{}M of memory, less than {mem}M", t.mem));
    }
    if t.cpu_power < wanted.cpu_power.unwrap_or(0) {
        short.push(format!("cpu-power {}, less than {}", t.cpu_power, wanted.cpu_power.unwrap_or(0)));
    }
    short
}

/// The root volume in GiB for a root-disk in MiB (rounded up, at least Juju's default).
pub fn root_disk_gib(root_disk_mib: Option<u64>) -> u64 {
    root_disk_mib.map(|mib| mib.div_ceil(1024).max(1)).unwrap_or(DEFAULT_ROOT_DISK_GIB)
}

/// One entry of the image metadata, as far as the choice needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageCandidate {
    pub id: String,
    pub arch: String,
    pub region: String,
    pub virt_type: Option<String>,
}

/// An `image-id` constraint, else the image metadata's image for this region
/// and architecture (hvm), else the config's image for the architecture.
pub fn image(
    config: &Config,
    arch: &str,
    constraint: Option<&str>,
    metadata: &[ImageCandidate],
) -> Result<String, Ec2Error> {
    let plain =
        |id: &str| id.starts_with("ami-") && id.len() <= 64 && id[4..].chars().all(|c| c.is_ascii_alphanumeric());
    if let Some(id) = constraint {
        return match plain(id) {
            true => Ok(id.to_owned()),
            false => Err(Ec2Error::InvalidParams(format!("image-id {id:?} is not an AMI id (ami-…)"))),
        };
    }
    let from_metadata = metadata.iter().find(|m| {
        (m.region.is_empty() || m.region == config.region)
            && normal_arch(&m.arch) == Some(arch)
            && m.virt_type.as_deref().is_none_or(|v| v == "hvm")
            && plain(&m.id)
    });
    if let Some(found) = from_metadata {
        return Ok(found.id.clone());
    }
    config.images.get(arch).cloned().ok_or_else(|| {
        Ec2Error::ZoneIndependent(format!(
            "no image for {arch} in {}: give image metadata for the region, or set images.{arch} in the provider config",
            config.region
        ))
    })
}

/// A zone the region reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zone {
    pub name: String,
    /// `available`, `impaired`, `unavailable`, …
    pub state: String,
}

/// What decides the zone of one start.
#[derive(Debug, Clone, Default)]
pub struct ZoneRequest<'a> {
    /// `zone=NAME` (the only placement EC2 takes here).
    pub placement: Option<&'a str>,
    /// A zone the host chose.
    pub availability_zone: Option<&'a str>,
    /// The `zones` constraint.
    pub allowed: Option<&'a [String]>,
    /// Members of the distribution group per zone.
    pub group_per_zone: BTreeMap<String, usize>,
}

/// The zones a start may use: available, in the config's list if any, in the constraint if any.
pub fn eligible_zones(config: &Config, zones: &[Zone], allowed: Option<&[String]>) -> Vec<String> {
    let mut names: Vec<String> = zones
        .iter()
        .filter(|z| z.state == "available")
        .filter(|z| config.zones.is_empty() || config.zones.contains(&z.name))
        .filter(|z| allowed.is_none_or(|a| a.contains(&z.name)))
        .map(|z| z.name.clone())
        .collect();
    names.sort();
    names.dedup();
    names
}

pub fn zone(config: &Config, zones: &[Zone], request: &ZoneRequest) -> Result<String, Ec2Error> {
    let eligible = eligible_zones(config, zones, request.allowed);
    let named = match (request.placement, request.availability_zone) {
        (Some(placement), _) => match placement.split_once('=') {
            Some(("zone", zone)) => Some(zone),
            _ => {
                return Err(Ec2Error::InvalidParams(format!(
                    "placement {placement:?} is not understood: EC2 takes zone=NAME"
                )));
            }
        },
        (None, zone) => zone.filter(|z| !z.is_empty()),
    };
    if let Some(zone) = named {
        if eligible.iter().any(|z| z == zone) {
            return Ok(zone.to_owned());
        }
        let why = match zones.iter().find(|z| z.name == zone) {
            None => format!("{} has no zone {zone:?}", config.region),
            Some(z) if z.state != "available" => format!("zone {zone} is {}", z.state),
            Some(_) => format!("zone {zone} is not among the allowed zones {eligible:?}"),
        };
        return Err(Ec2Error::InvalidParams(why));
    }
    eligible
        .iter()
        .min_by_key(|z| (request.group_per_zone.get(*z).copied().unwrap_or(0), (*z).clone()))
        .cloned()
        .ok_or_else(|| {
            Ec2Error::ZoneIndependent(format!(
                "no zone of {} is available and allowed (zones constraint {:?}, config zones {:?})",
                config.region,
                request.allowed.unwrap_or_default(),
                config.zones
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::parse(r#"{"namespace":"h","region":"us-east-1","images":{"amd64":"ami-0c0ffee0"}}"#).unwrap()
    }

    fn wanted(text: &str) -> Wanted {
        let mut w = Wanted::default();
        for part in text.split_whitespace() {
            let (k, v) = part.split_once('=').unwrap();
            match k {
                "arch" => w.arch = Some(v.into()),
                "cores" => w.cores = Some(v.parse().unwrap()),
                "mem" => w.mem = Some(v.parse().unwrap()),
                "cpu-power" => w.cpu_power = Some(v.parse().unwrap()),
                "instance-type" => w.instance_type = Some(v.into()),
                _ => panic!("{k}"),
            }
        }
        w
    }

    #[test]
    fn the_cheapest_type_that_fits() {
        let c = config();
        for (constraints, expected) in [
            ("", "t3.micro"), // Juju's 1 GiB floor, not the 0.5 GiB nano
            ("mem=512", "t3.nano"),
            ("mem=4096", "t3.medium"),
            ("mem=4097", "t3.large"),
            ("cores=4", "t3.xlarge"),
            ("cores=4 mem=8192", "t3.xlarge"),
            ("cores=8", "c5.2xlarge"),
            ("arch=arm64", "t4g.micro"),
            ("arch=aarch64 cores=8", "m6g.2xlarge"),
            ("cpu-power=400", "t3.xlarge"),
            ("instance-type=m5.large", "m5.large"),
            ("instance-type=x2iedn.metal", "x2iedn.metal"),
        ] {
            assert_eq!(instance_type(&c, &wanted(constraints)).unwrap().name, expected, "{constraints}");
        }
    }

    #[test]
    fn types_that_cannot_fit_are_zone_independent() {
        let c = config();
        for (constraints, needle) in [
            ("cores=64", "no instance type satisfies arch=amd64 cores=64"),
            ("arch=ppc64el", "ppc64el"),
            ("instance-type=t3.nano mem=2048", "t3.nano has 512M of memory"),
            ("instance-type=t4g.nano arch=amd64", "is arm64"),
        ] {
            let Err(Ec2Error::ZoneIndependent(m)) = instance_type(&c, &wanted(constraints)) else {
                panic!("{constraints}")
            };
            assert!(m.contains(needle), "{constraints}: {m}");
        }
        assert!(matches!(instance_type(&c, &wanted("instance-type=t3")), Err(Ec2Error::InvalidParams(_))));
    }

    #[test]
    fn root_disks_round_up_to_gib() {
        assert_eq!(root_disk_gib(None), 8);
        assert_eq!(root_disk_gib(Some(1)), 1);
        assert_eq!(root_disk_gib(Some(10 * 1024 + 1)), 11);
    }

    #[test]
    fn the_image_from_metadata_for_the_region_else_config() {
        let c = config();
        let m = |id: &str, arch: &str, region: &str, virt: Option<&str>| ImageCandidate {
            id: id.into(),
            arch: arch.into(),
            region: region.into(),
            virt_type: virt.map(Into::into),
        };
        let metadata = vec![
            m("ami-11111111", "amd64", "eu-west-1", None),
            m("ami-22222222", "amd64", "us-east-1", Some("pv")),
            m("ami-33333333", "arm64", "us-east-1", None),
            m("ami-44444444", "x86_64", "us-east-1", Some("hvm")),
        ];
        assert_eq!(image(&c, "amd64", None, &metadata).unwrap(), "ami-44444444");
        assert_eq!(image(&c, "arm64", None, &metadata).unwrap(), "ami-33333333");
        assert_eq!(image(&c, "amd64", None, &metadata[..2]).unwrap(), "ami-0c0ffee0");
        assert_eq!(image(&c, "amd64", Some("ami-99"), &metadata).unwrap(), "ami-99");
        assert!(matches!(image(&c, "amd64", Some("x&y"), &metadata), Err(Ec2Error::InvalidParams(_))));
        let Err(Ec2Error::ZoneIndependent(m)) = image(&c, "arm64", None, &[]) else { panic!() };
        assert!(m.contains("images.arm64"), "{m}");
    }

    fn zones() -> Vec<Zone> {
        ["us-east-1c", "us-east-1a", "us-east-1b", "us-east-1d"]
            .iter()
            .map(|n| Zone {
                name: (*n).into(),
                state: if *n == "us-east-1d" { "impaired" } else { "available" }.into(),
            })
            .collect()
    }

    #[test]
    fn the_emptiest_zone_of_the_group_ties_by_name() {
        let c = config();
        let mut request = ZoneRequest::default();
        assert_eq!(zone(&c, &zones(), &request).unwrap(), "us-east-1a");
        request.group_per_zone = [("us-east-1a".to_owned(), 2), ("us-east-1b".to_owned(), 1)].into();
        assert_eq!(zone(&c, &zones(), &request).unwrap(), "us-east-1c");
        request.group_per_zone.insert("us-east-1c".into(), 1);
        assert_eq!(zone(&c, &zones(), &request).unwrap(), "us-east-1b");
        let allowed = vec!["us-east-1a".to_owned()];
        request.allowed = Some(&allowed);
        assert_eq!(zone(&c, &zones(), &request).unwrap(), "us-east-1a");
    }

    #[test]
    fn a_named_zone_must_exist_and_be_allowed() {
        let c = config();
        let placed = |p: &str| zone(&c, &zones(), &ZoneRequest { placement: Some(p), ..ZoneRequest::default() });
        assert_eq!(placed("zone=us-east-1b").unwrap(), "us-east-1b");
        for (p, needle) in
            [("zone=nowhere", "has no zone"), ("zone=us-east-1d", "is impaired"), ("subnet=x", "not understood")]
        {
            let Err(Ec2Error::InvalidParams(m)) = placed(p) else { panic!("{p}") };
            assert!(m.contains(needle), "{p}: {m}");
        }
        let host = ZoneRequest { availability_zone: Some("us-east-1c"), ..ZoneRequest::default() };
        assert_eq!(zone(&c, &zones(), &host).unwrap(), "us-east-1c");
        let none = vec!["elsewhere".to_owned()];
        let request = ZoneRequest { allowed: Some(&none), ..ZoneRequest::default() };
        assert!(matches!(zone(&c, &zones(), &request), Err(Ec2Error::ZoneIndependent(_))));
    }
}
