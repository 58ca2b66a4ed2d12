//! The EC2 Query API forms this provider sends (`Action=…&Version=…`), as
//! ordered pairs. The host signs them; the guest never holds a credential.

use base64::Engine;

/// The EC2 API version every request names.
pub const VERSION: &str = "2016-11-15";
/// The root device of Ubuntu's AMIs, which the root volume size applies to.
pub const ROOT_DEVICE: &str = "/dev/sda1";
/// EC2's limits on tags: per resource, key and value length.
pub const MAX_TAGS: usize = 50;
pub const MAX_TAG_KEY: usize = 128;
pub const MAX_TAG_VALUE: usize = 256;
/// EC2 takes user data up to 16 KiB before base64.
pub const MAX_USER_DATA: usize = 16 * 1024;

pub type Form = Vec<(String, String)>;

fn action(name: &str) -> Form {
    vec![("Action".into(), name.into()), ("Version".into(), VERSION.into())]
}

/// One instance to run.
#[derive(Debug, Clone, Default)]
pub struct RunSpec {
    pub image_id: String,
    pub instance_type: String,
    pub zone: String,
    pub client_token: String,
    pub user_data: Option<Vec<u8>>,
    /// Every tag, the namespace's first: all set in the same call.
    pub tags: Vec<(String, String)>,
    pub root_disk_gib: u64,
    pub subnet_id: Option<String>,
    pub security_group_ids: Vec<String>,
    pub key_name: Option<String>,
}

pub fn run_instances(spec: &RunSpec) -> Form {
    let mut form = action("RunInstances");
    let mut put = |k: String, v: String| form.push((k, v));
    put("ImageId".into(), spec.image_id.clone());
    put("InstanceType".into(), spec.instance_type.clone());
    put("MinCount".into(), "1".into());
    put("MaxCount".into(), "1".into());
    put("ClientToken".into(), spec.client_token.clone());
    put("Placement.AvailabilityZone".into(), spec.zone.clone());
    put("BlockDeviceMapping.1.DeviceName".into(), ROOT_DEVICE.into());
    put("BlockDeviceMapping.1.Ebs.VolumeSize".into(), spec.root_disk_gib.to_string());
    put("BlockDeviceMapping.1.Ebs.DeleteOnTermination".into(), "true".into());
    if let Some(data) = &spec.user_data {
        put("UserData".into(), base64::engine::general_purpose::STANDARD.encode(data));
    }
    if let Some(subnet) = &spec.subnet_id {
        put("SubnetId".into(), subnet.clone());
    }
    for (i, group) in spec.security_group_ids.iter().enumerate() {
        put(format!("SecurityGroupId.{}", i + 1), group.clone());
    }
    if let Some(key) = &spec.key_name {
        put("KeyName".into(), key.clone());
    }
    // Tags in the same call: an instance is never untagged, so never lost to terminate's filter.
    put("TagSpecification.1.ResourceType".into(), "instance".into());
    for (i, (k, v)) in spec.tags.iter().enumerate() {
        put(format!("TagSpecification.1.Tag.{}.Key", i + 1), k.clone());
        put(format!("TagSpecification.1.Tag.{}.Value", i + 1), v.clone());
    }
    form
}

/// A filter of `Describe*`: name and values.
pub type Filter<'a> = (&'a str, Vec<String>);

/// `DescribeInstances` with filters, one page.
pub fn describe_instances(filters: &[Filter], next_token: Option<&str>, max_results: u32) -> Form {
    let mut form = action("DescribeInstances");
    for (i, (name, values)) in filters.iter().enumerate() {
        form.push((format!("Filter.{}.Name", i + 1), (*name).to_owned()));
        for (j, value) in values.iter().enumerate() {
            form.push((format!("Filter.{}.Value.{}", i + 1, j + 1), value.clone()));
        }
    }
    form.push(("MaxResults".into(), max_results.to_string()));
    if let Some(token) = next_token {
        form.push(("NextToken".into(), token.to_owned()));
    }
    form
}

pub fn terminate_instances(ids: &[String]) -> Form {
    let mut form = action("TerminateInstances");
    form.extend(ids.iter().enumerate().map(|(i, id)| (format!("InstanceId.{}", i + 1), id.clone())));
    form
}

pub fn describe_availability_zones() -> Form {
    action("DescribeAvailabilityZones")
}

pub fn create_tags(id: &str, tags: &[(String, String)]) -> Form {
    let mut form = action("CreateTags");
    form.push(("ResourceId.1".into(), id.to_owned()));
    for (i, (k, v)) in tags.iter().enumerate() {
        form.push((format!("Tag.{}.Key", i + 1), k.clone()));
        form.push((format!("Tag.{}.Value", i + 1), v.clone()));
    }
    form
}

/// The tags of one instance: the namespace's first, then a `Name`, then the
/// instance config's (never one that would hide the namespace's, nor `aws:`
/// ones, which EC2 refuses). Too many, or too long, is an error, not a cut.
pub fn instance_tags(
    namespace_tag: (&str, &str),
    name: &str,
    wanted: &[(String, String)],
) -> Result<Vec<(String, String)>, String> {
    let mut tags = vec![(namespace_tag.0.to_owned(), namespace_tag.1.to_owned()), ("Name".to_owned(), name.to_owned())];
    for (k, v) in wanted {
        if k == namespace_tag.0 {
            return Err(format!("tag {k:?} is this host's namespace tag; it cannot be set"));
        }
        if k.starts_with("aws:") {
            return Err(format!("tag {k:?}: keys starting with aws: are AWS's"));
        }
        if k.is_empty() || k.len() > MAX_TAG_KEY || v.len() > MAX_TAG_VALUE {
            return Err(format!("tag {:?}: keys are 1-{MAX_TAG_KEY} bytes, values at most {MAX_TAG_VALUE}", cut(k)));
        }
        match tags.iter_mut().find(|(have, _)| have == k) {
            Some(existing) => existing.1 = v.clone(),
            None => tags.push((k.clone(), v.clone())),
        }
    }
    if tags.len() > MAX_TAGS {
        return Err(format!("{} tags; EC2 takes at most {MAX_TAGS} on an instance", tags.len()));
    }
    Ok(tags)
}

fn cut(s: &str) -> &str {
    let mut end = s.len().min(40);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A `ClientToken` (at most 64 ASCII): the same start asked again (the same
/// machine nonce, namespace and zone) gets the same token, so EC2 answers it
/// with the instance it already made rather than a second one.
pub fn client_token(namespace: &str, nonce: &str, zone: &str) -> String {
    // FNV-1a over each part with its length: stable across builds and platforms.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [namespace, nonce, zone] {
        for byte in (part.len() as u64).to_le_bytes().iter().chain(part.as_bytes()) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let readable: String = namespace.chars().filter(char::is_ascii_alphanumeric).take(32).collect();
    format!("broker-{readable}-{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(form: &'a Form, key: &str) -> Option<&'a str> {
        form.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    #[test]
    fn run_instances_tags_in_the_same_call() {
        let spec = RunSpec {
            image_id: "ami-1".into(),
            instance_type: "t3.micro".into(),
            zone: "us-east-1b".into(),
            client_token: "tok".into(),
            user_data: Some(b"#cloud-config\n".to_vec()),
            tags: vec![("broker-namespace".into(), "h".into()), ("Name".into(), "juju-h-0".into())],
            root_disk_gib: 8,
            security_group_ids: vec!["sg-1".into(), "sg-2".into()],
            ..RunSpec::default()
        };
        let form = run_instances(&spec);
        assert_eq!(get(&form, "Action"), Some("RunInstances"));
        assert_eq!((get(&form, "MinCount"), get(&form, "MaxCount")), (Some("1"), Some("1")));
        assert_eq!(get(&form, "Placement.AvailabilityZone"), Some("us-east-1b"));
        assert_eq!(get(&form, "UserData"), Some("I2Nsb3VkLWNvbmZpZwo="));
        assert_eq!(get(&form, "TagSpecification.1.ResourceType"), Some("instance"));
        assert_eq!(get(&form, "TagSpecification.1.Tag.1.Key"), Some("broker-namespace"));
        assert_eq!(get(&form, "TagSpecification.1.Tag.2.Value"), Some("juju-h-0"));
        assert_eq!(get(&form, "SecurityGroupId.2"), Some("sg-2"));
        assert_eq!(get(&form, "SubnetId"), None);
    }

    #[test]
    fn describe_instances_pages_and_filters() {
        let form = describe_instances(
            &[("tag:k", vec!["v".into()]), ("instance-state-name", vec!["pending".into(), "running".into()])],
            Some("next"),
            100,
        );
        assert_eq!(get(&form, "Filter.1.Name"), Some("tag:k"));
        assert_eq!(get(&form, "Filter.2.Value.2"), Some("running"));
        assert_eq!(get(&form, "NextToken"), Some("next"));
    }

    #[test]
    fn the_namespace_tag_cannot_be_hidden() {
        let ns = ("broker-namespace", "h");
        let tags = instance_tags(ns, "n", &[("Name".into(), "mine".into()), ("team".into(), "a".into())]).unwrap();
        assert_eq!(
            tags,
            vec![("broker-namespace".into(), "h".into()), ("Name".into(), "mine".into()), ("team".into(), "a".into())]
        );
        assert!(
            instance_tags(ns, "n", &[("broker-namespace".into(), "other".into())]).unwrap_err().contains("namespace")
        );
        assert!(instance_tags(ns, "n", &[("aws:x".into(), "y".into())]).is_err());
        let many: Vec<(String, String)> = (0..49).map(|i| (format!("k{i}"), String::new())).collect();
        assert!(instance_tags(ns, "n", &many).unwrap_err().contains("at most 50"));
    }

    #[test]
    fn client_tokens_repeat_per_start_and_differ_per_zone() {
        let a = client_token("host0", "machine-1:uuid", "us-east-1a");
        assert_eq!(a, client_token("host0", "machine-1:uuid", "us-east-1a"));
        assert_ne!(a, client_token("host0", "machine-1:uuid", "us-east-1b"));
        assert_ne!(a, client_token("host0", "machine-2:uuid", "us-east-1a"));
        assert_ne!(client_token("ab", "c", "z"), client_token("a", "bc", "z"));
        assert!(a.len() <= 64 && a.is_ascii(), "{a}");
    }
}
