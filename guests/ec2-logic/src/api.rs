//! Reading EC2's XML answers: instances, zones, the next page, and errors as
//! the contract's kinds. Every answer is untrusted text: no DTD, a bound on
//! nodes, and fields cut to EC2's own sizes.

use crate::Ec2Error;
use crate::select::Zone;
use roxmltree::{Document, Node, ParsingOptions};

/// More nodes than a page of 1000 instances with 50 tags each ever needs.
const MAX_NODES: u32 = 1_000_000;
/// Longest field kept of an answer (ids, names, addresses, tag values are far shorter).
const MAX_FIELD: usize = 1024;
/// Longest `nextToken` taken whole (a cut token would be a wrong one: refused instead).
const MAX_TOKEN: usize = 64 << 10;

/// One instance as `DescribeInstances` or `RunInstances` tells it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ec2Instance {
    pub id: String,
    /// `pending`, `running`, `shutting-down`, `terminated`, `stopping`, `stopped`.
    pub state: String,
    pub state_reason: String,
    pub zone: String,
    pub instance_type: String,
    /// EC2's name: `x86_64`, `arm64`.
    pub architecture: String,
    pub private_ip: Option<String>,
    pub public_ip: Option<String>,
    pub private_dns: Option<String>,
    pub tags: Vec<(String, String)>,
}

impl Ec2Instance {
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.tags.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Juju's arch name.
    pub fn arch(&self) -> Option<&'static str> {
        match self.architecture.as_str() {
            "x86_64" => Some("amd64"),
            "arm64" => Some("arm64"),
            _ => None,
        }
    }
}

fn parse(body: &str) -> Result<Document<'_>, Ec2Error> {
    let options = ParsingOptions { allow_dtd: false, nodes_limit: MAX_NODES };
    Document::parse_with_options(body, options)
        .map_err(|e| Ec2Error::Provider(format!("EC2 answered something that is not XML: {e}")))
}

fn child<'a, 'i>(node: Node<'a, 'i>, name: &str) -> Option<Node<'a, 'i>> {
    node.children().find(|c| c.is_element() && c.tag_name().name() == name)
}

fn items<'a, 'i>(node: Node<'a, 'i>) -> impl Iterator<Item = Node<'a, 'i>> {
    node.children().filter(|c| c.is_element() && c.tag_name().name() == "item")
}

fn text(node: Node, name: &str) -> Option<String> {
    text_up_to(node, name, MAX_FIELD)
}

fn text_up_to(node: Node, name: &str, max: usize) -> Option<String> {
    let value = child(node, name)?.text()?.trim();
    if value.is_empty() {
        return None;
    }
    let mut end = value.len().min(max);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    Some(value[..end].to_owned())
}

fn instance(item: Node) -> Ec2Instance {
    let state = child(item, "instanceState");
    let tags = child(item, "tagSet")
        .into_iter()
        .flat_map(items)
        .filter_map(|t| Some((text(t, "key")?, text(t, "value").unwrap_or_default())))
        .collect();
    Ec2Instance {
        id: text(item, "instanceId").unwrap_or_default(),
        state: state.and_then(|s| text(s, "name")).unwrap_or_default(),
        state_reason: child(item, "stateReason").and_then(|r| text(r, "message")).unwrap_or_default(),
        zone: child(item, "placement").and_then(|p| text(p, "availabilityZone")).unwrap_or_default(),
        instance_type: text(item, "instanceType").unwrap_or_default(),
        architecture: text(item, "architecture").unwrap_or_default(),
        private_ip: text(item, "privateIpAddress"),
        public_ip: text(item, "ipAddress"),
        private_dns: text(item, "privateDnsName"),
        tags,
    }
}

/// The instances of a `RunInstancesResponse`.
pub fn run_instances(body: &str) -> Result<Vec<Ec2Instance>, Ec2Error> {
    let doc = parse(body)?;
    let set = child(doc.root_element(), "instancesSet")
        .ok_or_else(|| Ec2Error::Provider("RunInstances answered without an instancesSet".into()))?;
    Ok(items(set).map(instance).filter(|i| !i.id.is_empty()).collect())
}

/// One page of `DescribeInstancesResponse`: its instances and the next page's token.
pub fn describe_instances(body: &str) -> Result<(Vec<Ec2Instance>, Option<String>), Ec2Error> {
    let doc = parse(body)?;
    let root = doc.root_element();
    let reservations = child(root, "reservationSet")
        .ok_or_else(|| Ec2Error::Provider("DescribeInstances answered without a reservationSet".into()))?;
    let instances = items(reservations)
        .filter_map(|r| child(r, "instancesSet"))
        .flat_map(items)
        .map(instance)
        .filter(|i| !i.id.is_empty())
        .collect();
    let token = text_up_to(root, "nextToken", MAX_TOKEN + 1);
    if token.as_ref().is_some_and(|t| t.len() > MAX_TOKEN) {
        return Err(Ec2Error::Provider(format!("DescribeInstances answered a nextToken over {MAX_TOKEN} bytes")));
    }
    Ok((instances, token))
}

pub fn availability_zones(body: &str) -> Result<Vec<Zone>, Ec2Error> {
    let doc = parse(body)?;
    let info = child(doc.root_element(), "availabilityZoneInfo")
        .ok_or_else(|| Ec2Error::Provider("DescribeAvailabilityZones answered without availabilityZoneInfo".into()))?;
    Ok(items(info)
        .filter_map(|z| Some(Zone { name: text(z, "zoneName")?, state: text(z, "zoneState").unwrap_or_default() }))
        .collect())
}

/// EC2's error codes that mean the zone cannot take the instance now.
const CAPACITY: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientFreeAddressesInSubnet",
];

/// EC2's codes for a failure that the same request may not meet again.
const TRANSIENT: &[&str] =
    &["RequestLimitExceeded", "Throttling", "InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable"];

/// Whether an error answer is worth the same request again: a 5xx, or
/// throttling; never a zone out of capacity (EC2 answers that with a 500),
/// which the host's next zone is for.
pub fn transient(status: u16, body: &str) -> bool {
    let code = parse(body).ok().and_then(|doc| {
        doc.descendants()
            .find(|n| n.is_element() && n.tag_name().name() == "Code")
            .and_then(|n| n.text())
            .map(|code| code.trim().to_owned())
    });
    match code.as_deref() {
        Some(code) if CAPACITY.contains(&code) => false,
        Some(code) if TRANSIENT.contains(&code) => true,
        _ => status >= 500,
    }
}

/// An error answer (any non-2xx) as the contract's kind, with EC2's code and message.
pub fn error(status: u16, body: &str) -> Ec2Error {
    let found = parse(body).ok().and_then(|doc| {
        let error = doc.descendants().find(|n| n.is_element() && n.tag_name().name() == "Error")?;
        Some((text(error, "Code")?, text(error, "Message").unwrap_or_default()))
    });
    let Some((code, message)) = found else {
        let mut end = body.len().min(200);
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        return Ec2Error::Provider(format!("EC2 answered {status}: {}", &body[..end]));
    };
    let said = format!("EC2 {code}: {message}");
    match code.as_str() {
        c if CAPACITY.contains(&c) => Ec2Error::ZoneUnavailable(said),
        "Unsupported" if message.contains("vailability") || message.contains("zone") => Ec2Error::ZoneUnavailable(said),
        "AuthFailure"
        | "UnauthorizedOperation"
        | "Blocked"
        | "OptInRequired"
        | "SignatureDoesNotMatch"
        | "InvalidClientTokenId" => Ec2Error::AccessDenied(said),
        c if c.starts_with("InvalidInstanceID") => Ec2Error::NotFound(said),
        c if c.starts_with("InvalidAMIID") || c == "InvalidParameterCombination" => Ec2Error::ZoneIndependent(said),
        c if c.starts_with("Invalid") || c.starts_with("MissingParameter") || c == "IdempotentParameterMismatch" => {
            Ec2Error::InvalidParams(said)
        }
        _ => Ec2Error::Provider(said),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESCRIBE: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>r</requestId>
  <reservationSet>
    <item><reservationId>r-1</reservationId><instancesSet>
      <item><instanceId>i-aaa</instanceId><instanceState><code>16</code><name>running</name></instanceState>
        <privateDnsName>ip-10-0-0-1.ec2.internal</privateDnsName><instanceType>t3.micro</instanceType>
        <placement><availabilityZone>us-east-1a</availabilityZone></placement>
        <privateIpAddress>10.0.0.1</privateIpAddress><ipAddress>54.0.0.1</ipAddress><architecture>x86_64</architecture>
        <tagSet><item><key>broker-namespace</key><value>h</value></item><item><key>empty</key><value/></item></tagSet>
      </item>
      <item><instanceId>i-bbb</instanceId><instanceState><code>0</code><name>pending</name></instanceState></item>
    </instancesSet></item>
  </reservationSet>
  <nextToken>page2</nextToken>
</DescribeInstancesResponse>"#;

    #[test]
    fn instances_and_the_next_page() {
        let (instances, next) = describe_instances(DESCRIBE).unwrap();
        assert_eq!(next.as_deref(), Some("page2"));
        assert_eq!(instances.len(), 2);
        let a = &instances[0];
        assert_eq!((a.id.as_str(), a.state.as_str(), a.zone.as_str()), ("i-aaa", "running", "us-east-1a"));
        assert_eq!((a.arch(), a.public_ip.as_deref()), (Some("amd64"), Some("54.0.0.1")));
        assert_eq!(a.tag("broker-namespace"), Some("h"));
        assert_eq!(a.tag("empty"), Some(""));
        assert_eq!(instances[1].state, "pending");
        let last = DESCRIBE.replace("<nextToken>page2</nextToken>", "");
        assert_eq!(describe_instances(&last).unwrap().1, None);
    }

    #[test]
    fn zones_with_their_state() {
        let body = r#"<DescribeAvailabilityZonesResponse xmlns="x"><availabilityZoneInfo>
            <item><zoneName>us-east-1a</zoneName><zoneState>available</zoneState></item>
            <item><zoneName>us-east-1b</zoneName><zoneState>impaired</zoneState></item>
        </availabilityZoneInfo></DescribeAvailabilityZonesResponse>"#;
        let zones = availability_zones(body).unwrap();
        assert_eq!(zones[1], Zone { name: "us-east-1b".into(), state: "impaired".into() });
    }

    #[test]
    fn errors_become_the_contracts_kinds() {
        let err = |code: &str, message: &str| {
            error(
                400,
                &format!(
                    "<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>x</RequestID></Response>"
                ),
            )
        };
        assert!(
            matches!(err("InsufficientInstanceCapacity", "no room"), Ec2Error::ZoneUnavailable(m) if m.contains("no room"))
        );
        assert!(matches!(
            err("Unsupported", "not supported in your requested Availability Zone"),
            Ec2Error::ZoneUnavailable(_)
        ));
        assert!(matches!(err("AuthFailure", "x"), Ec2Error::AccessDenied(_)));
        assert!(matches!(err("InvalidInstanceID.NotFound", "x"), Ec2Error::NotFound(_)));
        assert!(matches!(err("InvalidAMIID.Malformed", "x"), Ec2Error::ZoneIndependent(_)));
        assert!(matches!(err("InvalidParameterValue", "x"), Ec2Error::InvalidParams(_)));
        assert!(matches!(err("RequestLimitExceeded", "x"), Ec2Error::Provider(_)));
        assert!(matches!(error(502, "<html>bad gateway"), Ec2Error::Provider(m) if m.contains("502")));
        let throttled = "<Response><Errors><Error><Code>RequestLimitExceeded</Code></Error></Errors></Response>";
        assert!(transient(400, throttled) && transient(503, "") && !transient(400, "<Response/>"));
        let full = "<Response><Errors><Error><Code>InsufficientInstanceCapacity</Code></Error></Errors></Response>";
        assert!(!transient(500, full), "a full zone is the host's to move on from, not to ask again");
    }

    #[test]
    fn a_long_next_token_is_taken_whole_or_refused() {
        let page = |token: &str| format!("<R><reservationSet/><nextToken>{token}</nextToken></R>");
        let long = "t".repeat(5000);
        assert_eq!(describe_instances(&page(&long)).unwrap().1.as_deref(), Some(long.as_str()));
        assert!(describe_instances(&page(&"t".repeat(MAX_TOKEN + 1))).is_err());
    }

    #[test]
    fn hostile_answers_are_errors_not_expansions() {
        let bomb =
            r#"<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;">]><x>&b;</x>"#;
        assert!(matches!(describe_instances(bomb), Err(Ec2Error::Provider(_))));
        assert!(matches!(run_instances("<RunInstancesResponse/>"), Err(Ec2Error::Provider(_))));
        let long = format!(
            "<R><reservationSet><item><instancesSet><item><instanceId>{}</instanceId></item></instancesSet></item></reservationSet></R>",
            "i".repeat(5000)
        );
        assert_eq!(describe_instances(&long).unwrap().0[0].id.len(), MAX_FIELD);
    }
}
