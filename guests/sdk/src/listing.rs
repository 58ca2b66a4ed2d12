//! Answering `all-instances` a page at a time.
//!
//! The host asks for a page of at most `size` instances from a cursor (the
//! previous page's `next`). A provider whose instances are keys of its kv
//! pages through them with [`crate::kv::scan_page`] and hands the last key
//! as the cursor; one that can only list everything at once (an API with no
//! paging) answers with [`page_of`].

use crate::types::{BrokerError, Instance, InstancePage, ListedInstance, PageRequest};

/// The `describe` feature of a provider whose pages are in id order: each
/// page's ids ascending, and above the page before's (as [`kv_page`] over
/// keys that are a fixed prefix and the id, and [`page_of`], list them). The
/// host then merges each page with its records of the ids it spans, so a
/// page of its listing costs what the page holds; without it, each page of
/// the host's listing is cut from a whole listing.
pub const ID_ORDERED_PAGES: &str = "id-ordered-pages";

/// An instance with nothing more known of it.
pub fn listed(instance: Instance) -> ListedInstance {
    ListedInstance { instance, display_name: String::new(), hardware: None, tags: Vec::new() }
}

/// The page `page` asks for of `all`, every instance there is: in id order,
/// after the cursor, which is the last id of the page before. Each page then
/// costs a whole listing: page natively where the backend can.
pub fn page_of(mut all: Vec<ListedInstance>, page: &PageRequest) -> InstancePage {
    all.sort_by(|a, b| a.instance.id.cmp(&b.instance.id));
    all.dedup_by(|a, b| a.instance.id == b.instance.id);
    let from = page.cursor.as_ref().map_or(0, |after| all.partition_point(|listed| listed.instance.id <= *after));
    let size = page.size.max(1) as usize;
    let mut rest = all.split_off(from);
    let more = rest.len() > size;
    rest.truncate(size);
    let next = if more { rest.last().map(|listed| listed.instance.id.clone()) } else { None };
    InstancePage { instances: rest, next }
}

/// A page of instances kept one per kv key under `prefix`: the entries after
/// the cursor (the last key of the page before), each made an instance by
/// `each` (none: not one to list; the page is then shorter, which is allowed).
pub fn kv_page(
    prefix: &str,
    page: &PageRequest,
    mut each: impl FnMut(&str, &[u8]) -> Result<Option<ListedInstance>, BrokerError>,
) -> Result<InstancePage, BrokerError> {
    let (entries, more) = crate::kv::scan_count(prefix, page.cursor.as_deref(), page.size.max(1) as usize)?;
    let next = if more { entries.last().map(|(key, _)| key.clone()) } else { None };
    let mut instances = Vec::with_capacity(entries.len());
    for (key, value) in &entries {
        instances.extend(each(key, value)?);
    }
    Ok(InstancePage { instances, next })
}
