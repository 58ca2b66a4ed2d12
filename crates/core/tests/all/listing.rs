//! The listing a page at a time: pages merged from each provider's own pages
//! and a range of the host's records are, put together, the whole listing —
//! records the provider does not list, instances the host never recorded,
//! several providers — and a provider whose pages cannot be merged (out of
//! order, a cursor holding a secret) is listed whole, never wrongly.

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::KvBackend;
use broker_core::broker::listing::ProviderAt;
use broker_core::broker::{Broker, InstanceRecord, ListCursor};
use broker_tests::{bundled_manifest_text, wasm};
use std::path::Path;

/// What a listing shows of a record, to compare two listings by.
fn shown(records: &[InstanceRecord]) -> Vec<(String, String, String, String)> {
    records.iter().map(|r| (r.provider.clone(), r.id.clone(), r.status.clone(), r.message.clone())).collect()
}

/// Every page from `from`, of at most `limit`, put together; and how many pages.
async fn paged(
    broker: &Broker,
    only: Option<&str>,
    mut from: Option<ListCursor>,
    limit: usize,
) -> (Vec<InstanceRecord>, usize) {
    let (mut all, mut pages) = (Vec::new(), 0);
    loop {
        let page = broker.instances_page(only, from, limit).await.unwrap();
        assert!(page.records.len() <= limit, "a page of {} asked for {limit}", page.records.len());
        pages += 1;
        assert!(pages < 1000, "the listing does not end");
        all.extend(page.records);
        // What the API hands out is what it takes back.
        from =
            page.next.map(|next| ListCursor::parse(&next.to_text(broker.cursor_key()), broker.cursor_key()).unwrap());
        if from.is_none() {
            return (all, pages);
        }
    }
}

fn fake_named(dir: &Path, name: &str, prefix: &str) -> std::path::PathBuf {
    let text = bundled_manifest_text("fake")
        .replace("name = \"fake\"", &format!("name = \"{name}\""))
        .replace("prefix = \"fake\"", &format!("prefix = \"{prefix}\""));
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn the_pages_of_a_listing_put_together_are_the_whole_listing() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    broker.registry().add(&fake_named(dir.path(), "fake", "fake")).await.unwrap();
    broker.registry().add(&fake_named(dir.path(), "fake-b", "b")).await.unwrap();
    broker.registry().add(&fake_named(dir.path(), "fake-c", "c")).await.unwrap();
    let hooks = CallHooks::default();
    for _ in 0..23 {
        broker.start_instance("fake", &empty_params(), &hooks).await.unwrap();
    }
    for _ in 0..4 {
        broker.start_instance("fake-b", &empty_params(), &hooks).await.unwrap();
    }
    // A record the provider no longer lists, and an instance the host never recorded.
    let kv = broker.store().kv();
    let kept = kv.get("fake", "instance/fake-14").unwrap().unwrap();
    assert!(kv.delete("fake", "instance/fake-3").unwrap());
    let renamed: Vec<u8> = String::from_utf8_lossy(&kept).replace("fake-14", "fake-9x").into_bytes();
    kv.set("fake", "instance/fake-9x", &renamed).unwrap();

    let whole = broker.list_instances(None).await.unwrap();
    assert_eq!(whole.len(), 23 + 4 + 1, "{:?}", shown(&whole));
    let unknown = whole.iter().find(|r| r.id == "fake-3").unwrap();
    assert_eq!((unknown.status.as_str(), unknown.message.as_str()), ("unknown", "not reported by the provider"));
    let unrecorded = whole.iter().find(|r| r.id == "fake-9x").unwrap();
    assert!(unrecorded.created.is_empty() && unrecorded.status == "running", "{unrecorded:?}");

    for limit in [1, 2, 5, 7, 23, 24, 100] {
        let (listed, pages) = paged(&broker, None, None, limit).await;
        assert_eq!(shown(&listed), shown(&whole), "pages of {limit}");
        assert!(pages >= whole.len().div_ceil(limit), "{pages} pages of {limit}");
    }
    // Merged from the provider's own pages, not cut from a whole listing.
    let first = broker.instances_page(Some("fake"), None, 5).await.unwrap().next.unwrap();
    assert!(matches!(first.at, ProviderAt::Next { .. }), "{first:?}");
    let one_page = broker.instances_page(Some("fake"), None, 1).await.unwrap().next.unwrap();
    let at = ProviderAt::Next { cursor: "instance/fake-0".into(), above: Some("fake-0".into()) };
    assert_eq!(one_page.at, at, "a page of one goes on from the provider's next");
    let one = broker.provider_instances("fake").await.unwrap();
    for limit in [1, 3, 10] {
        assert_eq!(shown(&paged(&broker, Some("fake"), None, limit).await.0), shown(&one), "fake, pages of {limit}");
    }
    // A cursor of the form before paging, `PROVIDER/ID`, goes on after that id.
    let (rest, _) = paged(&broker, None, Some(ListCursor::parse("fake/fake-5", broker.cursor_key()).unwrap()), 4).await;
    let from = whole.iter().position(|r| r.id == "fake-5").unwrap() + 1;
    assert_eq!(shown(&rest), shown(&whole[from..]));
    // One past the last of a provider goes on with the next.
    let (rest, _) = paged(&broker, None, Some(ListCursor::parse("fake/zzz", broker.cursor_key()).unwrap()), 4).await;
    assert!(rest.iter().all(|r| r.provider == "fake-b") && rest.len() == 4, "{:?}", shown(&rest));
}

/// Hostile providers that say their pages are in id order and list
/// otherwise: a page out of order is seen and the provider listed whole,
/// rightly; pages that go backwards garble only the liar's own part (its
/// ids in order, each once), never the next provider's; pages without end
/// are refused past the most it may have, and the listing goes on.
#[tokio::test]
async fn pages_out_of_order_garble_only_their_own_provider() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    for (name, mode) in [("backwards", "pages-backwards"), ("endless", "pages-endless"), ("unsorted", "page-unsorted")]
    {
        let text = format!(
            "name = \"{name}\"\ncomponent = \"{}\"\n[limits]\nmax-records = 40\n[grants]\nkv = true\n[config]\nmode = \"{mode}\"\nflood-entries = 7\n",
            wasm("test-hostile").display()
        );
        std::fs::write(dir.path().join(format!("{name}.toml")), text).unwrap();
        broker.registry().add(&dir.path().join(format!("{name}.toml"))).await.unwrap();
    }
    let whole = broker.list_instances(None).await.unwrap();
    let ids = |records: &[InstanceRecord], provider: &str| -> Vec<String> {
        records.iter().filter(|r| r.provider == provider).map(|r| r.id.clone()).collect()
    };
    let backwards: Vec<String> = (0..7).map(|i| format!("i-{i:04}")).collect();
    assert_eq!(ids(&whole, "backwards"), backwards);
    assert_eq!(ids(&whole, "unsorted"), ["i-1", "i-2", "i-3"]);
    // A page of one would be a page of more than asked from "unsorted": a broken contract of its own.
    for limit in [2, 3, 4, 100] {
        let (listed, _) = paged(&broker, None, None, limit).await;
        assert_eq!(ids(&listed, "unsorted"), ids(&whole, "unsorted"), "pages of {limit}");
        let garbled = ids(&listed, "backwards");
        assert!(garbled.windows(2).all(|w| w[0] < w[1]), "pages of {limit}: {garbled:?}");
        assert!(garbled.iter().all(|id| backwards.contains(id)), "pages of {limit}: {garbled:?}");
        assert!(listed.iter().all(|r| r.provider == "backwards" || r.provider == "unsorted"));
    }
    // Pages without end: refused past three times as many as it may list instances, and one.
    let mut from = None;
    let refused = loop {
        match broker.instances_page(Some("endless"), from, 10).await {
            Ok(page) => {
                assert!(page.records.is_empty());
                from = Some(page.next.expect("an endless listing never says it is at its end"));
            }
            Err(refused) => break refused.to_string(),
        }
    };
    assert!(refused.contains("more than 123 pages"), "{refused}");
}
