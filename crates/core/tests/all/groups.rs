//! Groups on the fake, through the real host: plans, passes, rolling updates,
//! quorum groups, destroy-instances, free and destroy, and a restart mid-way.
//! Most tests drive passes one by one (`converge_once`) so that what each pass
//! does is checked; the restart test runs the loops as `broker serve` does.

use broker_capabilities::rooms::kv::KvBackend;
use broker_core::broker::Broker;
use broker_core::groups::{GroupError, GroupSettings, Groups, Pass};
use broker_tests::write_manifest;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spec(size: &str, constraints: &str) -> String {
    format!(
        r#"{{"ID": "workers", "Properties": {{
            "Allocation": {size},
            "Instance": {{"Plugin": "fake", "Properties": {{"Constraints": "{constraints}", "Tags": {{"role": "worker"}}}}}},
            "Flavor": {{"Plugin": "vanilla", "Properties": {{"Init": ["echo hello"]}}}}}}}}"#
    )
}

fn sized(size: u32) -> String {
    spec(&format!(r#"{{"Size": {size}}}"#), "mem=1G")
}

async fn host(dir: &Path, config: &str) -> (Arc<Broker>, Arc<Groups>) {
    let settings = GroupSettings { poll: Duration::from_millis(50), ..GroupSettings::default() };
    host_with(dir, config, settings).await
}

async fn host_with(dir: &Path, config: &str, settings: GroupSettings) -> (Arc<Broker>, Arc<Groups>) {
    let broker = Arc::new(Broker::open(&dir.join("data")).unwrap());
    add_fake(&broker, dir, "fake", config).await;
    (broker.clone(), Groups::new(broker, settings))
}

async fn add_fake(broker: &Broker, dir: &Path, name: &str, config: &str) {
    let manifest = write_manifest(
        dir,
        name,
        "fake",
        &format!("[limits]\nmemory-mib = 64\n[grants]\nkv = true\n[config]\n{config}\n"),
    );
    broker.registry().add(&manifest).await.unwrap();
}

/// Passes until one changes nothing (at most 60).
async fn converge(groups: &Groups, id: &str) -> usize {
    for pass in 1..=60 {
        if groups.converge_once(id).await.unwrap() == Pass::Steady {
            return pass;
        }
    }
    panic!("group {id} did not settle in 60 passes");
}

async fn member_ids(groups: &Groups) -> Vec<String> {
    groups.describe("workers").await.unwrap().instances.into_iter().map(|m| m.id).collect()
}

fn events_of(broker: &Broker, after: u64) -> Vec<(String, String)> {
    let events = broker.store().events(after, 10_000).unwrap();
    events.into_iter().filter(|e| e.group.is_some()).map(|e| (e.kind.to_string(), e.detail)).collect()
}

#[tokio::test]
async fn a_group_scales_0_5_2_0_with_infrakits_plans_and_its_events() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    assert_eq!(groups.commit_text(&sized(0), false).await.unwrap(), "Managing 0 instances");
    converge(&groups, "workers").await;
    assert!(member_ids(&groups).await.is_empty());

    assert_eq!(
        groups.commit_text(&sized(5), false).await.unwrap(),
        "Adding 5 instances to increase the group size to 5"
    );
    converge(&groups, "workers").await;
    let five = groups.describe("workers").await.unwrap();
    assert_eq!(five.instances.len(), 5);
    assert!(five.converged);
    for member in &five.instances {
        assert_eq!(member.tags["infrakit.group"], "workers");
        assert_eq!(member.tags["role"], "worker");
        assert_eq!(member.tags["infrakit.config.hash"].len(), 32);
        assert_eq!(member.status, "running");
    }

    assert_eq!(groups.set_size("workers", 2).await.unwrap(), "Terminating 3 instances to reduce the group size to 2");
    assert_eq!(groups.size("workers").unwrap(), 2);
    converge(&groups, "workers").await;
    // The surplus went by id: the two that sort last stay.
    let mut ids: Vec<String> = five.instances.iter().map(|m| m.id.clone()).collect();
    ids.sort();
    assert_eq!(member_ids(&groups).await, ids[3..]);

    assert_eq!(groups.set_size("workers", 0).await.unwrap(), "Terminating 2 instances to reduce the group size to 0");
    converge(&groups, "workers").await;
    assert!(member_ids(&groups).await.is_empty());
    assert!(broker.list_instances(Some("fake")).await.unwrap().is_empty(), "the provider has none left either");

    let kinds: Vec<String> = events_of(&broker, 0).into_iter().map(|(kind, _)| kind).collect();
    let count = |kind: &str| kinds.iter().filter(|k| *k == kind).count();
    assert_eq!(
        (count("group-committed"), count("instance-added"), count("instance-destroyed"), count("converged")),
        (4, 5, 5, 4),
        "{kinds:?}"
    );
}

#[tokio::test]
async fn pretend_changes_nothing_and_bad_commits_are_refused_before_anything_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    assert_eq!(groups.commit_text(&sized(3), true).await.unwrap(), "Managing 3 instances");
    assert!(matches!(groups.size("workers"), Err(GroupError::UnknownGroup(_))), "a pretend commit commits nothing");
    groups.commit_text(&sized(3), false).await.unwrap();
    converge(&groups, "workers").await;

    let snapshot = |broker: &Broker| {
        let kv = broker.store().kv();
        let fake_kv: Vec<_> = (0..3).map(|i| kv.get("fake", &format!("instance/fake-{i}")).unwrap()).collect();
        (
            broker.store().instances(None).unwrap(),
            fake_kv,
            broker.store().events(0, 10_000).unwrap(),
            broker.store().groups().unwrap(),
        )
    };
    let before = snapshot(&broker);
    let changed = spec(r#"{"Size": 5}"#, "mem=2G");
    assert_eq!(
        groups.commit_text(&changed, true).await.unwrap(),
        "Performing a rolling update on 3 instances, then adding 2 instances to increase the group size to 5"
    );
    assert_eq!(
        groups.commit_text(&sized(1), true).await.unwrap(),
        "Terminating 2 instances to reduce the group size to 1"
    );
    assert_eq!(groups.commit_text(&sized(3), true).await.unwrap(), "Noop");
    let wrong_provider = sized(3).replace(r#""Plugin": "fake""#, r#""Plugin": "nosuch""#);
    let refused = groups.commit_text(&wrong_provider, false).await.unwrap_err().to_string();
    assert!(refused.contains(r#"Properties.Instance.Plugin: no provider "nosuch""#), "{refused}");
    let unknown_field = sized(3).replace("Constraints", "Constraint");
    let refused = groups.commit_text(&unknown_field, false).await.unwrap_err().to_string();
    assert!(refused.contains("unknown field `Constraint`"), "{refused}");
    assert_eq!(snapshot(&broker), before, "records, the provider's kv, events and specs are as they were");
}

#[tokio::test]
async fn an_instance_stopped_behind_the_groups_back_is_replaced_in_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    groups.commit_text(&sized(3), false).await.unwrap();
    converge(&groups, "workers").await;
    let before = member_ids(&groups).await;
    // Gone from the provider: its record stays, listed as unknown.
    assert!(broker.store().kv().delete("fake", &format!("instance/{}", before[0])).unwrap());
    assert!(!groups.describe("workers").await.unwrap().converged);
    // Lost within minutes of its start: it counts toward stopping replacements.
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Replaced { failed_passes: 1 });
    let after = groups.describe("workers").await.unwrap();
    assert!(after.converged, "{after:?}");
    assert_eq!(after.instances.len(), 3);
    assert!(!after.instances.iter().any(|m| m.id == before[0]), "its record is gone");
    let replaced: Vec<_> = events_of(&broker, 0).into_iter().filter(|(kind, _)| kind == "instance-replaced").collect();
    assert_eq!(replaced.len(), 1, "{replaced:?}");
    assert!(replaced[0].1.starts_with(&format!("{}: unknown", before[0])), "{replaced:?}");
}

#[tokio::test]
async fn a_template_change_rolls_one_member_at_a_time_and_converges_again() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    groups.commit_text(&sized(4), false).await.unwrap();
    converge(&groups, "workers").await;
    let old_hash = groups.describe("workers").await.unwrap().instances[0].tags["infrakit.config.hash"].clone();
    let seq = broker.store().events(0, 10_000).unwrap().last().unwrap().seq;

    let plan = groups.commit_text(&spec(r#"{"Size": 4}"#, "mem=2G"), false).await.unwrap();
    assert_eq!(plan, "Performing a rolling update on 4 instances");
    let mut fewest = usize::MAX;
    for _ in 0..60 {
        let described = groups.describe("workers").await.unwrap();
        fewest = fewest.min(described.instances.iter().filter(|m| m.status == "running").count());
        if described.converged {
            break;
        }
        groups.converge_once("workers").await.unwrap();
    }
    let done = groups.describe("workers").await.unwrap();
    assert!(done.converged, "{done:?}");
    assert!(done.instances.iter().all(|m| m.tags["infrakit.config.hash"] != old_hash));
    assert!(fewest >= 3, "never fewer than size - 1 healthy members: saw {fewest}");
    // From the events: each step destroys one old member, and its replacement
    // is added before the next step.
    let events: Vec<String> = events_of(&broker, seq).into_iter().map(|(kind, _)| kind).collect();
    let steps: Vec<&str> =
        events.iter().map(String::as_str).filter(|k| *k == "update-step" || *k == "instance-added").collect();
    assert_eq!(steps, ["update-step", "instance-added"].repeat(4), "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("converged"), "{events:?}");
    let params = broker.store().instance("fake", &done.instances[0].id).unwrap().unwrap().params.unwrap();
    assert_eq!(params.constraints.mem, Some(2048), "the new template");
}

#[tokio::test]
async fn a_quorum_group_keeps_exactly_its_logical_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    let quorum = |ids: &str| spec(&format!(r#"{{"LogicalIDs": [{ids}]}}"#), "mem=1G");
    assert_eq!(groups.commit_text(&quorum(r#""m1", "m2", "m3""#), false).await.unwrap(), "Managing 3 instances");
    converge(&groups, "workers").await;
    let logical = |described: &broker_core::groups::GroupDescription| {
        let mut ids: Vec<String> = described.instances.iter().filter_map(|m| m.logical_id.clone()).collect();
        ids.sort();
        ids
    };
    assert_eq!(logical(&groups.describe("workers").await.unwrap()), ["m1", "m2", "m3"]);

    let m2 =
        groups.describe("workers").await.unwrap().instances.into_iter().find(|m| m.logical_id.as_deref() == Some("m2"));
    assert!(broker.store().kv().delete("fake", &format!("instance/{}", m2.unwrap().id)).unwrap());
    let plan = groups.commit_text(&quorum(r#""m1", "m2", "m4""#), false).await.unwrap();
    assert_eq!(plan, "Adding 2 instances for logical ids m2, m4, then Terminating 1 instances of logical ids m3");
    converge(&groups, "workers").await;
    let described = groups.describe("workers").await.unwrap();
    assert_eq!(logical(&described), ["m1", "m2", "m4"]);
    assert!(described.converged);
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 3, "no stray instance");
    assert!(matches!(groups.set_size("workers", 5).await, Err(GroupError::QuorumSize(_))));
}

#[tokio::test]
async fn destroy_instances_free_and_destroy() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    let outsider = broker
        .start_instance("fake", &broker_capabilities::contract::empty_params(), &Default::default())
        .await
        .unwrap()
        .id;
    groups.commit_text(&sized(4), false).await.unwrap();
    converge(&groups, "workers").await;
    let ids = member_ids(&groups).await;

    let error = groups.destroy_instances("workers", &[ids[0].clone(), outsider.clone()]).await.unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("instance {outsider:?} is not a member of group \"workers\": nothing was destroyed")
    );
    assert_eq!(member_ids(&groups).await, ids, "nothing was destroyed");

    // One id twice is one instance: the size goes down by one.
    groups.destroy_instances("workers", &[ids[0].clone(), ids[0].clone()]).await.unwrap();
    assert_eq!(groups.size("workers").unwrap(), 3);
    groups.destroy_instances("workers", &ids[1..2]).await.unwrap();
    assert_eq!(groups.size("workers").unwrap(), 2, "the size is reduced before the call returns");
    assert_eq!(member_ids(&groups).await, ids[2..]);
    converge(&groups, "workers").await;
    assert_eq!(member_ids(&groups).await, ids[2..], "not made again");

    groups.free("workers").await.unwrap();
    assert!(matches!(groups.describe("workers").await, Err(GroupError::UnknownGroup(_))));
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Gone);
    let listed = broker.list_instances(Some("fake")).await.unwrap();
    assert_eq!(listed.len(), 3, "freed members run on, with the outsider");
    assert!(listed.iter().all(|r| !r.instance_tags.contains_key("infrakit.group")), "recorded as ungrouped");

    // A new group of the same name adopts none of them; destroying it destroys only its own.
    groups.commit_text(&sized(2), false).await.unwrap();
    converge(&groups, "workers").await;
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 5);
    groups.destroy("workers").await.unwrap();
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 3);
    assert!(groups.inspect().unwrap().is_empty());
}

#[tokio::test]
async fn a_failed_stop_in_destroy_instances_shrinks_once_and_stops_no_other_member() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "stops-fail = true").await;
    groups.commit_text(&sized(3), false).await.unwrap();
    converge(&groups, "workers").await;
    let ids = member_ids(&groups).await;

    let error = groups.destroy_instances("workers", &ids[..1]).await.unwrap_err();
    assert!(error.to_string().contains("fake config stops-fail"), "{error}");
    // The smaller size, the member's leaving and its stop mark were written before the stop.
    assert_eq!(groups.size("workers").unwrap(), 2);
    assert_eq!(member_ids(&groups).await, ids[1..]);
    // Passes neither make it again nor stop another member in its place.
    converge(&groups, "workers").await;
    assert_eq!(member_ids(&groups).await, ids[1..]);
    assert_eq!(
        broker.list_instances(Some("fake")).await.unwrap().len(),
        3,
        "the failed stop's instance is still recorded"
    );
    // Asked again: it is no longer a member, so the group does not shrink twice.
    let again = groups.destroy_instances("workers", &ids[..1]).await.unwrap_err();
    assert!(matches!(again, GroupError::NotAMember { .. }), "{again}");
    assert_eq!(groups.size("workers").unwrap(), 2);
    // The next host finds its stop unfinished, for its reconcile to end.
    drop((groups, broker));
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    assert_eq!(broker.store().interrupted_stops("fake").unwrap(), ids[..1], "marked for the next stop");
}

/// The loops as `broker serve` runs them, cut off mid-way (starts in flight
/// dropped with the host), then a new host: reconcile, loops, and the group
/// ends at its size with no duplicate and no orphan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_convergence_resumes_and_ends_converged_without_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (broker, groups) = host(dir.path(), "answer-delay-ms = 40").await;
        groups.start_loops().unwrap();
        groups.commit_text(&sized(12), false).await.unwrap();
        let until = Instant::now() + Duration::from_secs(30);
        while broker.list_instances(Some("fake")).await.unwrap().len() < 4 {
            assert!(Instant::now() < until, "the loop started nothing");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        groups.stop_loops();
    }
    // The aborted loops let go of the host as the runtime drops them.
    let data = dir.path().join("data");
    let broker = Arc::new(Broker::open_when_free(&data, Duration::from_secs(10), async || true).await.unwrap());
    broker.reconcile_after_restart(broker_core::broker::reconcile::HarvestMode::Destroyed).await;
    let groups = Groups::new(broker.clone(), GroupSettings { poll: Duration::from_millis(50), ..Default::default() });
    groups.start_loops().unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let described = groups.describe("workers").await.unwrap();
        if described.converged {
            break;
        }
        assert!(Instant::now() < until, "not converged: {described:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    groups.stop_loops();
    let listed = broker.list_instances(Some("fake")).await.unwrap();
    assert_eq!(listed.len(), 12, "exactly the group's size, every one recorded: {listed:?}");
    assert!(listed.iter().all(|r| !r.created.is_empty() && r.instance_tags["infrakit.group"] == "workers"));
}

/// Juju's zone rule with the group as the distribution group: each start goes
/// to the allowed zone with fewest members (ties by name), and one answering
/// `zone-unavailable` sends the start on to the next.
#[tokio::test]
async fn members_spread_over_the_zones_and_an_unavailable_zone_is_skipped() {
    let zoned = |size: u32| spec(&format!(r#"{{"Size": {size}}}"#), "mem=1G zones=zone-a,zone-b,zone-c");
    let per_zone = |listed: Vec<broker_core::store::InstanceRecord>| {
        let mut counts = std::collections::BTreeMap::new();
        for record in listed {
            *counts.entry(record.hardware.availability_zone.unwrap_or_default()).or_insert(0) += 1;
        }
        counts.into_iter().collect::<Vec<(String, usize)>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    groups.commit_text(&zoned(6), false).await.unwrap();
    converge(&groups, "workers").await;
    let spread = per_zone(broker.list_instances(Some("fake")).await.unwrap());
    assert_eq!(spread, [("zone-a".into(), 2), ("zone-b".into(), 2), ("zone-c".into(), 2)]);

    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), r#"unavailable-zones = ["zone-b"]"#).await;
    groups.commit_text(&zoned(4), false).await.unwrap();
    converge(&groups, "workers").await;
    let spread = per_zone(broker.list_instances(Some("fake")).await.unwrap());
    assert_eq!(spread, [("zone-a".into(), 2), ("zone-c".into(), 2)]);
    let skipped = events_of(&broker, 0).into_iter().filter(|(kind, _)| kind == "zone-unavailable").count();
    assert!(skipped >= 1, "each start placed in zone-b went on to the next zone");
    assert!(groups.describe("workers").await.unwrap().converged);
}

/// Juju's provisioner, for single starts and groups without a zones
/// constraint alike: a start the provider placed in a full zone is placed by
/// the host in the provider's other zones (those its `describe` lists),
/// emptiest first; a zone the caller named is not second-guessed; with every
/// zone full the caller hears zone-unavailable.
#[tokio::test]
async fn a_start_turned_away_by_a_full_zone_is_placed_by_the_host_in_the_next() {
    use broker_capabilities::bindings::BrokerError;
    use broker_capabilities::contract::empty_params;
    use broker_core::broker::BrokerServiceError;
    use broker_core::version::CallError;
    let zone_of = |r: &broker_core::store::InstanceRecord| r.hardware.availability_zone.clone().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), r#"unavailable-zones = ["zone-a"]"#).await;
    let mut landed = Vec::new();
    for _ in 0..3 {
        landed.push(zone_of(&broker.start_instance("fake", &empty_params(), &Default::default()).await.unwrap()));
    }
    assert_eq!(landed, ["zone-b", "zone-c", "zone-b"]);

    let mut placed = empty_params();
    placed.placement = Some("zone=zone-a".into());
    let refused = broker.start_instance("fake", &placed, &Default::default()).await.unwrap_err();
    let unavailable = |e: &BrokerServiceError| {
        matches!(e, BrokerServiceError::Call(CallError::Guest { error: BrokerError::ZoneUnavailable(_), .. }))
    };
    assert!(unavailable(&refused), "{refused}");
    assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), 3, "nothing placed elsewhere");

    let mut only_full = empty_params();
    only_full.constraints.zones = Some(vec!["zone-a".into()]);
    let refused = broker.start_instance("fake", &only_full, &Default::default()).await.unwrap_err();
    assert!(unavailable(&refused), "{refused}");

    // A group with no zones constraint: each member the same way (started
    // side by side, so how they spread over the two is the group's race).
    groups.commit_text(&spec(r#"{"Size": 4}"#, "mem=1G"), false).await.unwrap();
    converge(&groups, "workers").await;
    let members: Vec<String> = (broker.list_instances(Some("fake")).await.unwrap().iter())
        .filter(|r| r.instance_tags.get("infrakit.group").map(String::as_str) == Some("workers"))
        .map(zone_of)
        .collect();
    assert_eq!(members.len(), 4, "{members:?}");
    assert!(members.iter().all(|z| z != "zone-a"), "{members:?}");
}

/// Members that fail as they start are replaced with growing waits between
/// passes, and after `max_failed_passes` such passes in a row the group stops
/// replacing, says why, and is not converged, until its spec is committed again.
#[tokio::test]
async fn members_failing_as_they_start_are_not_replaced_in_a_tight_loop() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), r#"failed-zones = ["zone-a"]"#).await;
    // Every member goes to zone-a, whose instances the fake lists as failed.
    let failing = spec(r#"{"Size": 2}"#, "mem=1G zones=zone-a");
    groups.commit_text(&failing, false).await.unwrap();
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Changed, "the first two start");
    let max = GroupSettings::default().max_failed_passes;
    for failed_passes in 1..max {
        assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Replaced { failed_passes });
    }
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Steady, "replacing stops");
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Steady, "and stays stopped");
    let described = groups.describe("workers").await.unwrap();
    assert!(!described.converged, "{described:?}");
    let why = described.update_stopped.unwrap();
    assert!(why.contains(&format!("on {max} passes in a row")) && why.contains("error"), "{why}");
    let kinds: Vec<String> = events_of(&broker, 0).into_iter().map(|(kind, _)| kind).collect();
    let count = |kind: &str| kinds.iter().filter(|k| *k == kind).count();
    let replaced_passes = usize::try_from(max - 1).unwrap();
    assert_eq!(count("instance-added"), 2 + 2 * replaced_passes, "{kinds:?}");
    assert_eq!(count("replacement-stopped"), 1, "{kinds:?}");

    // The loop's waits after such passes grow: 1 s, 2 s, 4 s, … at most the poll.
    let poll = Duration::from_secs(10);
    let waits: Vec<Duration> = (1..=5).map(|failed_passes| Pass::Replaced { failed_passes }.wait(poll)).collect();
    assert_eq!(waits, [1, 2, 4, 8, 10].map(Duration::from_secs));
    assert_eq!(Pass::Changed.wait(poll), Duration::ZERO);

    // Committing again resumes.
    assert_eq!(groups.commit_text(&failing, false).await.unwrap(), "Noop");
    assert!(groups.describe("workers").await.unwrap().update_stopped.is_none());
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Replaced { failed_passes: 1 });
}

/// A rolling update whose replacement is listed running but never answers
/// `maintain-instance` stops after its patience, with an event, `Converged`
/// false and the reason in `describe`; the older members stay; a commit of
/// the old spec rolls the bad member back.
#[tokio::test]
async fn an_update_whose_replacement_never_becomes_healthy_stops_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let settings = GroupSettings {
        poll: Duration::from_millis(50),
        update_patience: Duration::from_millis(200),
        ..GroupSettings::default()
    };
    let (broker, groups) = host_with(dir.path(), r#"unhealthy-tag = "fake.unhealthy""#, settings).await;
    groups.commit_text(&sized(3), false).await.unwrap();
    converge(&groups, "workers").await;
    let good_hash = groups.describe("workers").await.unwrap().instances[0].tags["infrakit.config.hash"].clone();
    let seq = broker.store().events(0, 10_000).unwrap().last().unwrap().seq;

    let unhealthy =
        sized(3).replace(r#""Tags": {"role": "worker"}"#, r#""Tags": {"role": "worker", "fake.unhealthy": "yes"}"#);
    assert_eq!(groups.commit_text(&unhealthy, false).await.unwrap(), "Performing a rolling update on 3 instances");
    let until = Instant::now() + Duration::from_secs(30);
    while groups.describe("workers").await.unwrap().update_stopped.is_none() {
        assert!(Instant::now() < until, "the update never stopped");
        groups.converge_once("workers").await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..3 {
        groups.converge_once("workers").await.unwrap();
    }
    let described = groups.describe("workers").await.unwrap();
    assert!(!described.converged);
    assert!(described.update_stopped.as_deref().unwrap().contains("was not healthy within"), "{described:?}");
    let good = described.instances.iter().filter(|m| m.tags["infrakit.config.hash"] == good_hash).count();
    assert_eq!((described.instances.len(), good), (3, 2), "one step only: {described:?}");
    assert!(described.instances.iter().all(|m| m.status == "running"));
    let kinds: Vec<String> = events_of(&broker, seq).into_iter().map(|(kind, _)| kind).collect();
    let count = |kind: &str| kinds.iter().filter(|k| *k == kind).count();
    assert_eq!((count("update-step"), count("update-stopped"), count("converged")), (1, 1, 0), "{kinds:?}");

    assert_eq!(groups.commit_text(&sized(3), false).await.unwrap(), "Performing a rolling update on 1 instances");
    converge(&groups, "workers").await;
    let described = groups.describe("workers").await.unwrap();
    assert!(described.converged, "{described:?}");
    assert!(described.instances.iter().all(|m| m.tags["infrakit.config.hash"] == good_hash));
}

/// What a commit may not change, and commits racing for one new group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_cannot_switch_allocation_or_provider_and_racing_first_commits_agree() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    add_fake(&broker, dir.path(), "other", r#"prefix = "other""#).await;
    groups.commit_text(&sized(2), false).await.unwrap();
    converge(&groups, "workers").await;
    let quorum = spec(r#"{"LogicalIDs": ["a", "b"]}"#, "mem=1G");
    for pretend in [true, false] {
        let refused = groups.commit_text(&quorum, pretend).await.unwrap_err();
        assert!(matches!(refused, GroupError::AllocationChanged { .. }), "{refused}");
        assert!(refused.to_string().contains("Properties.Allocation"), "{refused}");
    }
    assert_eq!(groups.describe("workers").await.unwrap().instances.len(), 2, "nothing destroyed");

    // Two first commits of one group, naming different providers, at once:
    // one commits, the other is refused, and only one provider runs members.
    for round in 0..5 {
        let id = format!("race-{round}");
        let on = |provider: &str| {
            sized(1).replace("\"workers\"", &format!("{id:?}")).replace("\"fake\"", &format!("{provider:?}"))
        };
        let (a, b) = (on("fake"), on("other"));
        let (first, second) = tokio::join!(groups.commit_text(&a, false), groups.commit_text(&b, false));
        let refused = match (first, second) {
            (Ok(_), Err(refused)) | (Err(refused), Ok(_)) => refused,
            other => panic!("exactly one commit must win: {other:?}"),
        };
        assert!(matches!(refused, GroupError::ProviderChanged { .. }), "{refused}");
    }
}

/// A group whose provider was removed can still be freed, not destroyed, and
/// a stored spec that no longer reads hides no other group and can be freed.
#[tokio::test]
async fn groups_outlive_their_provider_and_a_bad_stored_spec() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, groups) = host(dir.path(), "").await;
    add_fake(&broker, dir.path(), "other", r#"prefix = "other""#).await;
    let idle = sized(0).replace("\"workers\"", "\"idle\"").replace("\"fake\"", "\"other\"");
    groups.commit_text(&idle, false).await.unwrap();
    groups.commit_text(&sized(1), false).await.unwrap();
    broker.registry().remove("other").await.unwrap();
    let refused = groups.destroy("idle").await.unwrap_err();
    assert!(matches!(refused, GroupError::ProviderGone { .. }), "{refused}");
    assert!(refused.to_string().contains("broker group free idle"), "{refused}");
    groups.free("idle").await.unwrap();

    // A spec an older or damaged store holds: it reads as JSON, but not as a group.
    let broken = broker_core::store::GroupRecord {
        spec: serde_json::json!({"ID": "broken", "Properties": {"Instance": {"Plugin": "fake"}, "Bogus": 1}}),
        committed: "2026-01-01T00:00:00Z".into(),
    };
    let event = broker_core::store::Event::new(broker_core::store::EventKind::Other("test".into()), "fake");
    assert!(broker.store().put_group("broken", &broken, &event, 10).await.unwrap());
    let listed: Vec<String> = groups.inspect().unwrap().into_iter().map(|spec| spec.id).collect();
    assert_eq!(listed, ["workers"], "the bad one is left out, the good one listed");
    let error = groups.describe("broken").await.unwrap_err();
    assert!(matches!(error, GroupError::StoredSpec { .. }), "{error}");
    groups.free("broken").await.unwrap();
    assert!(broker.store().group("broken").unwrap().is_none());
}

/// A pass starts at most 4 × max-parallel members, so the group's lock is
/// let go between batches (a commit or destroy never waits out thousands of
/// starts); the next passes start the rest.
#[tokio::test]
async fn a_pass_starts_a_bounded_batch() {
    let dir = tempfile::tempdir().unwrap();
    let settings = GroupSettings { poll: Duration::from_millis(50), max_parallel: 2, ..GroupSettings::default() };
    let (_broker, groups) = host_with(dir.path(), "", settings).await;
    groups.commit_text(&sized(20), false).await.unwrap();
    assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Changed);
    assert_eq!(member_ids(&groups).await.len(), 8, "one batch of 4 × 2");
    converge(&groups, "workers").await;
    assert_eq!(member_ids(&groups).await.len(), 20);
    assert!(groups.describe("workers").await.unwrap().converged);
}

/// A provider that cannot answer its listing (here: more instances than its
/// `max-records`) leaves the group as it is: the pass fails, saying why, and
/// no member is taken for lost, stopped or replaced, however many passes run.
/// (The operator's listing of all shows the same records as `unknown`; a
/// group must not act on that.)
#[tokio::test]
async fn a_listing_the_provider_cannot_answer_stops_or_replaces_no_member() {
    let dir = tempfile::tempdir().unwrap();
    let limits =
        |bound: usize| format!("[limits]\nmemory-mib = 64\nmax-records = {bound}\n[grants]\nkv = true\n[config]\n");
    let manifest = write_manifest(dir.path(), "fake", "fake", &limits(3));
    let settings = GroupSettings { poll: Duration::from_millis(50), ..GroupSettings::default() };
    {
        let broker = Arc::new(Broker::open(&dir.path().join("data")).unwrap());
        broker.registry().add(&manifest).await.unwrap();
        let groups = Groups::new(broker.clone(), settings);
        groups.commit_text(&sized(3), false).await.unwrap();
        assert_eq!(groups.converge_once("workers").await.unwrap(), Pass::Changed);
    }
    // The operator lowers its bound: from then on every answer is past it.
    write_manifest(dir.path(), "fake", "fake", &limits(2));
    let broker = Arc::new(Broker::open(&dir.path().join("data")).unwrap());
    let groups = Groups::new(broker.clone(), settings);
    let recorded =
        || -> Vec<String> { broker.store().instances(Some("fake")).unwrap().into_iter().map(|r| r.id).collect() };
    let started = recorded();
    assert_eq!(started.len(), 3, "{started:?}");
    for _ in 0..3 {
        let failed = groups.converge_once("workers").await.unwrap_err().to_string();
        assert!(failed.contains("max-records limit of 2"), "{failed}");
    }
    assert_eq!(recorded(), started, "no member stopped or added");
    // And the provider still has each (its kv, which a stop would have emptied).
    for id in &started {
        assert!(broker.store().kv().get("fake", &format!("instance/{id}")).unwrap().is_some(), "{id} stopped");
    }
    let kinds: Vec<String> = events_of(&broker, 0).into_iter().map(|(kind, _)| kind).collect();
    assert!(!kinds.iter().any(|k| k == "instance-replaced" || k == "instance-destroyed"), "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "instance-added").count(), 3, "{kinds:?}");
    // The operator's listing of all: its records, unknown, the reason named.
    let shown = broker.list_instances(None).await.unwrap();
    assert_eq!(shown.len(), 3);
    assert!(shown.iter().all(|r| r.status == "unknown" && r.message.contains("max-records")), "{shown:?}");
}
