//! The `group` socket: InfraKit's Group/0.1.1 over this host's groups.
//! Every request names its object (`Name`: the plugin, as the client
//! addresses it, echoed) and, but for `InspectGroups`, the group (`ID`).

use super::rpc::{RpcError, or_default, params};
use broker_core::groups::spec::{Group, GroupSpec};
use broker_core::groups::{Groups, MemberDescription};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

/// The interface and version this socket speaks; a client refuses any other.
pub(crate) const GROUP_API: (&str, &str) = ("Group", "0.1.1");

/// The methods, as `/info/api.json` lists them, with an example of each one's params.
pub(crate) fn methods() -> Vec<(&'static str, Value)> {
    vec![
        ("Group.CommitGroup", json!({"Name": "group", "Spec": {"ID": "workers", "Properties": {}}, "Pretend": true})),
        ("Group.DescribeGroup", json!({"Name": "group", "ID": "workers"})),
        ("Group.DestroyGroup", json!({"Name": "group", "ID": "workers"})),
        ("Group.FreeGroup", json!({"Name": "group", "ID": "workers"})),
        ("Group.InspectGroups", json!({"Name": "group"})),
        ("Group.DestroyInstances", json!({"Name": "group", "ID": "workers", "Instances": ["fake-0"]})),
        ("Group.Size", json!({"Name": "group", "ID": "workers"})),
        ("Group.SetSize", json!({"Name": "group", "ID": "workers", "Size": 3})),
    ]
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Commit {
    #[serde(default, deserialize_with = "or_default")]
    name: String,
    spec: GroupSpec,
    #[serde(default, deserialize_with = "or_default")]
    pretend: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Named {
    #[serde(default, deserialize_with = "or_default")]
    name: String,
    #[serde(rename = "ID", default, deserialize_with = "or_default")]
    id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DestroyInstances {
    #[serde(default, deserialize_with = "or_default")]
    name: String,
    #[serde(rename = "ID")]
    id: String,
    #[serde(default, deserialize_with = "or_default")]
    instances: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SetSize {
    #[serde(default, deserialize_with = "or_default")]
    name: String,
    #[serde(rename = "ID")]
    id: String,
    size: i64,
}

fn server(error: broker_core::groups::GroupError) -> RpcError {
    RpcError::server(&error)
}

/// One call of the group plugin; `None` if it has no such method.
pub(crate) async fn call(groups: &Arc<Groups>, method: &str, raw: Value) -> Option<Result<Value, RpcError>> {
    let outcome = match method {
        "Group.CommitGroup" => commit(groups, raw).await,
        "Group.DescribeGroup" => describe(groups, raw).await,
        "Group.DestroyGroup" => match params::<Named>(raw) {
            Ok(p) => groups.destroy(&p.id).await.map(|()| json!({"Name": p.name, "ID": p.id})).map_err(server),
            Err(e) => Err(e),
        },
        "Group.FreeGroup" => match params::<Named>(raw) {
            Ok(p) => groups.free(&p.id).await.map(|()| json!({"Name": p.name, "ID": p.id})).map_err(server),
            Err(e) => Err(e),
        },
        "Group.InspectGroups" => match params::<Named>(raw) {
            Ok(p) => groups.inspect().map(|specs| json!({"Name": p.name, "Groups": specs})).map_err(server),
            Err(e) => Err(e),
        },
        "Group.DestroyInstances" => match params::<DestroyInstances>(raw) {
            Ok(p) => groups
                .destroy_instances(&p.id, &p.instances)
                .await
                .map(|()| json!({"Name": p.name, "ID": p.id}))
                .map_err(server),
            Err(e) => Err(e),
        },
        "Group.Size" => match params::<Named>(raw) {
            Ok(p) => groups.size(&p.id).map(|size| json!({"Name": p.name, "ID": p.id, "Size": size})).map_err(server),
            Err(e) => Err(e),
        },
        "Group.SetSize" => set_size(groups, raw).await,
        _ => return None,
    };
    Some(outcome)
}

async fn commit(groups: &Arc<Groups>, raw: Value) -> Result<Value, RpcError> {
    let p: Commit = params(raw)?;
    let id = p.spec.id.clone();
    let group = Group::check(p.spec).map_err(|e| RpcError::server(&e))?;
    let details = groups.commit(group, p.pretend).await.map_err(server)?;
    Ok(json!({"Name": p.name, "ID": id, "Details": details}))
}

async fn describe(groups: &Arc<Groups>, raw: Value) -> Result<Value, RpcError> {
    let p: Named = params(raw)?;
    let described = groups.describe(&p.id).await.map_err(server)?;
    let instances: Vec<Value> = described.instances.iter().map(instance_description).collect();
    Ok(json!({"Name": p.name, "ID": p.id, "Description": {"Instances": instances, "Converged": described.converged}}))
}

/// A member as InfraKit's `instance.Description`: its status in `Properties`.
pub(crate) fn instance_description(member: &MemberDescription) -> Value {
    let mut described = json!({
        "ID": member.id,
        "Tags": member.tags,
        "Properties": {"Status": member.status, "Message": member.message},
    });
    if let Some(logical_id) = &member.logical_id {
        described["LogicalID"] = json!(logical_id);
    }
    described
}

async fn set_size(groups: &Arc<Groups>, raw: Value) -> Result<Value, RpcError> {
    let p: SetSize = params(raw)?;
    let size = u32::try_from(p.size).map_err(|_| RpcError::params(format!("Size {} is not a group size", p.size)))?;
    groups.set_size(&p.id, size).await.map_err(server)?;
    Ok(json!({"Name": p.name, "ID": p.id}))
}
