//! `broker group …`: InfraKit's group calls, through the daemon or, without
//! one, on the state directly (the spec and records change; members follow
//! only while `broker serve` runs its convergence loops).

use super::UsageError;
use super::backend::Backend;
use crate::client::encode_component;
use anyhow::{Context, Result};
use broker_core::groups::spec::{Group, GroupSpec, MAX_SPEC_BYTES};
use broker_core::groups::{GroupDescription, Groups};
use clap::Subcommand;
use http::Method;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Subcommand)]
pub(crate) enum GroupCommand {
    /// Commit a group spec (InfraKit's: {"ID", "Properties": {"Allocation":
    /// {"Size" | "LogicalIDs"}, "Instance": {"Plugin", "Properties"}, "Flavor",
    /// "Updating"}}, JSON or YAML) and print the plan ("Adding 2 instances to
    /// increase the group size to 5"). The group then converges while `broker
    /// serve` runs. See the README's "Groups" section for the fields.
    Commit {
        /// The spec file.
        file: PathBuf,
        /// Only print the plan: nothing is committed or changed.
        #[arg(long)]
        pretend: bool,
    },
    /// List the groups: id, provider, size, members, converged.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// A group's members (id, logical id, status, tags) and whether it has converged.
    Describe {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// The committed spec of one group, or of all, as JSON.
    Inspect { id: Option<String> },
    /// Print a group's size, or commit a new one and print the plan.
    Size { id: String, size: Option<u32> },
    /// Destroy these members and shrink the group by as many. An id that is
    /// not a member fails the call, and then nothing is destroyed.
    DestroyInstances {
        id: String,
        #[arg(required = true)]
        instances: Vec<String>,
    },
    /// Forget the group; its instances run on, recorded as ungrouped.
    Free { id: String },
    /// Destroy the group's instances and forget it.
    Destroy { id: String },
}

impl GroupCommand {
    /// Whether it was asked for JSON.
    pub(crate) fn json(&self) -> bool {
        matches!(self, GroupCommand::Ls { json: true } | GroupCommand::Describe { json: true, .. })
    }
}

/// Said after a change made without a daemon.
const NO_LOOP: &str = "no broker daemon serves this data dir: the group converges while `broker serve` runs";

pub(crate) async fn run(backend: &Backend, command: GroupCommand, out: &mut impl Write) -> Result<()> {
    let embedded = matches!(backend, Backend::Embedded(_));
    match command {
        GroupCommand::Commit { file, pretend } => {
            let text = tokio::task::spawn_blocking(move || {
                let bytes = broker_core::manifest::read_regular_file(&file, MAX_SPEC_BYTES as u64)
                    .with_context(|| format!("cannot read the group spec {}", file.display()))?;
                String::from_utf8(bytes).with_context(|| format!("the group spec {} is not UTF-8", file.display()))
            })
            .await??;
            let group = Group::parse(&text).map_err(|e| UsageError(e.to_string()))?;
            let plan = commit(backend, group, pretend).await?;
            writeln!(out, "{plan}")?;
            if embedded && !pretend {
                writeln!(out, "({NO_LOOP})")?;
            }
        }
        GroupCommand::Ls { json } => {
            let groups = list(backend).await?;
            if json {
                writeln!(out, "{}", super::output::json_pretty(&groups)?)?;
            } else {
                writeln!(out, "{:<24} {:<16} {:>5} {:>8}  CONVERGED", "GROUP", "PROVIDER", "SIZE", "MEMBERS")?;
                for g in &groups {
                    let converged = if g.converged { "yes" } else { "no" };
                    writeln!(
                        out,
                        "{:<24} {:<16} {:>5} {:>8}  {converged}",
                        g.id,
                        g.provider,
                        g.size,
                        g.instances.len()
                    )?;
                }
            }
        }
        GroupCommand::Describe { id, json } => {
            let described = describe(backend, &id).await?;
            if json {
                writeln!(out, "{}", super::output::json_pretty(&described)?)?;
            } else {
                let converged = if described.converged { "yes" } else { "no" };
                writeln!(
                    out,
                    "group {} (provider {}): size {}, converged: {converged}",
                    id, described.provider, described.size
                )?;
                if let Some(why) = &described.update_stopped {
                    writeln!(out, "rolling update stopped: {why}")?;
                }
                for m in &described.instances {
                    let lid = m.logical_id.as_deref().unwrap_or("-");
                    let hash = m
                        .tags
                        .get(broker_core::groups::spec::CONFIG_HASH_TAG)
                        .map_or("-", |h| h.get(..12).unwrap_or(h));
                    writeln!(out, "  {:<32} {:<12} {:<14} config {hash}", m.id, lid, m.status)?;
                }
            }
        }
        GroupCommand::Inspect { id } => {
            let specs = inspect(backend).await?;
            let specs: Vec<GroupSpec> =
                specs.into_iter().filter(|s| id.as_ref().is_none_or(|id| &s.id == id)).collect();
            if let Some(id) = &id
                && specs.is_empty()
            {
                anyhow::bail!(broker_core::groups::GroupError::UnknownGroup(id.clone()));
            }
            writeln!(out, "{}", super::output::json_pretty(&specs)?)?;
        }
        GroupCommand::Size { id, size: None } => writeln!(out, "{}", size(backend, &id).await?)?,
        GroupCommand::Size { id, size: Some(size) } => {
            writeln!(out, "{}", set_size(backend, &id, size).await?)?;
            if embedded {
                writeln!(out, "({NO_LOOP})")?;
            }
        }
        GroupCommand::DestroyInstances { id, instances } => {
            destroy_instances(backend, &id, &instances).await?;
            writeln!(out, "destroyed {} instances of group {id}", instances.len())?;
        }
        GroupCommand::Free { id } => {
            forget(backend, &id, false).await?;
            writeln!(out, "freed group {id}: its instances run on, ungrouped")?;
        }
        GroupCommand::Destroy { id } => {
            forget(backend, &id, true).await?;
            writeln!(out, "destroyed group {id} and its instances")?;
        }
    }
    Ok(())
}

fn embedded_groups(broker: &std::sync::Arc<broker_core::broker::Broker>) -> std::sync::Arc<Groups> {
    Groups::new(broker.clone(), Default::default())
}

fn group_path(id: &str, rest: &str) -> String {
    format!("/v1/groups/{}{rest}", encode_component(id))
}

#[derive(serde::Deserialize)]
struct Plan {
    plan: String,
}

async fn commit(backend: &Backend, group: Group, pretend: bool) -> Result<String> {
    match backend {
        Backend::Embedded(broker) => Ok(embedded_groups(broker).commit(group, pretend).await?),
        Backend::Daemon(client) => {
            let body = serde_json::to_value(&group.spec)?;
            let answer: Plan = client.call(Method::POST, &format!("/v1/groups?pretend={pretend}"), Some(body)).await?;
            Ok(answer.plan)
        }
    }
}

async fn list(backend: &Backend) -> Result<Vec<GroupDescription>> {
    match backend {
        Backend::Embedded(broker) => {
            let groups = embedded_groups(broker);
            let mut described = Vec::new();
            for spec in groups.inspect()? {
                described.push(groups.describe(&spec.id).await?);
            }
            Ok(described)
        }
        Backend::Daemon(client) => Ok(client.call(Method::GET, "/v1/groups", None).await?),
    }
}

async fn describe(backend: &Backend, id: &str) -> Result<GroupDescription> {
    match backend {
        Backend::Embedded(broker) => Ok(embedded_groups(broker).describe(id).await?),
        Backend::Daemon(client) => Ok(client.call(Method::GET, &group_path(id, ""), None).await?),
    }
}

async fn inspect(backend: &Backend) -> Result<Vec<GroupSpec>> {
    match backend {
        Backend::Embedded(broker) => Ok(embedded_groups(broker).inspect()?),
        Backend::Daemon(client) => {
            let described: Vec<GroupDescription> = client.call(Method::GET, "/v1/groups", None).await?;
            let mut specs = Vec::new();
            for group in described {
                specs.push(client.call(Method::GET, &group_path(&group.id, "/spec"), None).await?);
            }
            Ok(specs)
        }
    }
}

async fn size(backend: &Backend, id: &str) -> Result<usize> {
    #[derive(serde::Deserialize)]
    struct Size {
        size: usize,
    }
    match backend {
        Backend::Embedded(broker) => Ok(embedded_groups(broker).size(id)?),
        Backend::Daemon(client) => Ok(client.call::<Size>(Method::GET, &group_path(id, "/size"), None).await?.size),
    }
}

async fn set_size(backend: &Backend, id: &str, size: u32) -> Result<String> {
    match backend {
        Backend::Embedded(broker) => Ok(embedded_groups(broker).set_size(id, size).await?),
        Backend::Daemon(client) => {
            let body = json!({ "size": size });
            Ok(client.call::<Plan>(Method::PUT, &group_path(id, "/size"), Some(body)).await?.plan)
        }
    }
}

async fn destroy_instances(backend: &Backend, id: &str, instances: &[String]) -> Result<()> {
    match backend {
        Backend::Embedded(broker) => Ok(embedded_groups(broker).destroy_instances(id, instances).await?),
        Backend::Daemon(client) => {
            let body = json!({ "instances": instances });
            client.call::<serde_json::Value>(Method::POST, &group_path(id, "/destroy-instances"), Some(body)).await?;
            Ok(())
        }
    }
}

async fn forget(backend: &Backend, id: &str, destroy: bool) -> Result<()> {
    match backend {
        Backend::Embedded(broker) if destroy => Ok(embedded_groups(broker).destroy(id).await?),
        Backend::Embedded(broker) => Ok(embedded_groups(broker).free(id).await?),
        Backend::Daemon(client) => {
            let (method, path) = match destroy {
                true => (Method::DELETE, group_path(id, "")),
                false => (Method::POST, group_path(id, "/free")),
            };
            client.call::<serde_json::Value>(method, &path, None).await?;
            Ok(())
        }
    }
}
