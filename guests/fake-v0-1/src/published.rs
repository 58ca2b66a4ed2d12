//! What the SDK of an earlier contract version gave the fake's source, for
//! the builds of it against that version (`fake-v0-1`, `fake-v0-2`): its
//! `Guest` (today's shape, with a paged `all-instances`), the listing records
//! that came with 0.3.0, and the adapter that exports the version's own
//! `instance-broker`, whose `all-instances` answers every instance at once.
//! Each build's crate root has the version's bindings and a `kv::scan`.

use crate::CallContext;
use crate::broker::provider::types::{BrokerError, Instance, ProviderInfo, StartInstanceParams, StartInstanceResult};
use crate::exports::broker::provider::instance_broker;

/// The version's types, and 0.3.0's listing records beside them (in the
/// guest only: they never cross to the host).
pub mod types {
    pub use crate::broker::provider::types::*;

    pub struct PageRequest {
        pub cursor: Option<String>,
        pub size: u32,
    }

    pub struct ListedInstance {
        pub instance: Instance,
        pub display_name: String,
        pub hardware: Option<HardwareCharacteristics>,
        pub tags: Vec<(String, String)>,
    }

    pub struct InstancePage {
        pub instances: Vec<ListedInstance>,
        pub next: Option<String>,
    }
}

use types::{InstancePage, PageRequest};

/// The provider, as the source implements it.
pub trait Guest {
    fn describe() -> ProviderInfo;
    fn validate_config(config: String) -> Result<(), BrokerError>;
    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError>;
    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError>;
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError>;
    fn maintain_instance(ctx: &CallContext, id: String, params: StartInstanceParams) -> Result<(), BrokerError>;
}

pub mod listing {
    use super::types::{InstancePage, ListedInstance, PageRequest};
    use crate::broker::provider::types::BrokerError;

    /// What the SDK names it (an older host does not read it).
    pub const ID_ORDERED_PAGES: &str = "id-ordered-pages";

    /// The entries under `prefix` after the cursor, from one whole scan.
    pub fn kv_page(
        prefix: &str,
        page: &PageRequest,
        mut each: impl FnMut(&str, &[u8]) -> Result<Option<ListedInstance>, BrokerError>,
    ) -> Result<InstancePage, BrokerError> {
        let after = |key: &String| page.cursor.as_ref().is_none_or(|cursor| key > cursor);
        let entries: Vec<_> = crate::kv::scan(prefix)?.into_iter().filter(|(key, _)| after(key)).collect();
        let size = page.size.max(1) as usize;
        let next = (entries.len() > size).then(|| entries[size - 1].0.clone());
        let mut instances = Vec::new();
        for (key, value) in entries.iter().take(size) {
            instances.extend(each(key, value)?);
        }
        Ok(InstancePage { instances, next })
    }
}

/// The entries packed as `kv.scan` packs them: `[u32 LE length][key]`,
/// `[u32 LE length][value]`, repeated.
pub fn unpack(packed: &[u8]) -> Result<Vec<(String, Vec<u8>)>, crate::host_kv::KvError> {
    use crate::host_kv::KvError;
    fn chunk<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], KvError> {
        let truncated = || KvError::Invalid("scan buffer is truncated".into());
        let current: &'a [u8] = rest;
        let len: [u8; 4] = current.get(..4).ok_or_else(truncated)?.try_into().map_err(|_| truncated())?;
        let len = u32::from_le_bytes(len) as usize;
        let bytes = current.get(4..4 + len).ok_or_else(truncated)?;
        *rest = &current[4 + len..];
        Ok(bytes)
    }
    let mut entries = Vec::new();
    let mut rest = packed;
    while !rest.is_empty() {
        let key =
            String::from_utf8(chunk(&mut rest)?.to_vec()).map_err(|_| KvError::Invalid("a non-UTF-8 key".into()))?;
        entries.push((key, chunk(&mut rest)?.to_vec()));
    }
    Ok(entries)
}

/// The version's export: every page, as one answer.
pub struct Published;

impl instance_broker::Guest for Published {
    fn describe() -> ProviderInfo {
        crate::provider::Fake::describe()
    }
    fn validate_config(config: String) -> Result<(), BrokerError> {
        crate::provider::Fake::validate_config(config)
    }
    fn start_instance(ctx: &CallContext, params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        crate::provider::Fake::start_instance(ctx, params)
    }
    fn stop_instances(ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        crate::provider::Fake::stop_instances(ctx, ids)
    }
    fn all_instances(ctx: &CallContext) -> Result<Vec<Instance>, BrokerError> {
        let mut all = Vec::new();
        let mut cursor = None;
        loop {
            let page = crate::provider::Fake::all_instances(ctx, PageRequest { cursor, size: 1000 })?;
            all.extend(page.instances.into_iter().map(|listed| listed.instance));
            match page.next {
                None => return Ok(all),
                next => cursor = next,
            }
        }
    }
    fn maintain_instance(ctx: &CallContext, id: String, params: StartInstanceParams) -> Result<(), BrokerError> {
        crate::provider::Fake::maintain_instance(ctx, id, params)
    }
}
