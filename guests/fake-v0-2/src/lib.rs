//! The fake provider's source (`guests/fake/src/provider.rs`, unchanged)
//! built against `broker:provider@0.2.0` as published: a component built
//! before 0.3.0, which the host serves as it is. This crate stands in for the
//! SDK the source names (`broker_guest`) as 0.2.0 had it: claims and
//! `scan-page` are the host's; the listing is 0.2.0's, every instance in one
//! answer (`published.rs`, shared with the 0.1.0 build).

extern crate self as broker_guest;

wit_bindgen::generate!({
    path: "../../wit/0.2.0",
    world: "provider",
    additional_derives: [serde::Serialize, serde::Deserialize, PartialEq],
});

pub use broker::provider::context::CallContext;
pub use broker::provider::kv as host_kv;
pub use published::{Guest, listing, types};

#[path = "../../fake-v0-1/src/published.rs"]
mod published;

/// `kv.scan-page`, decoded, a page at a time.
pub mod kv {
    use crate::host_kv::KvError;

    pub fn scan(prefix: &str) -> Result<Vec<(String, Vec<u8>)>, KvError> {
        let mut entries: Vec<(String, Vec<u8>)> = Vec::new();
        loop {
            let after = entries.last().map(|(key, _)| key.clone());
            let page = crate::published::unpack(&crate::host_kv::scan_page(prefix, after.as_deref(), 4 << 20)?)?;
            if page.is_empty() {
                return Ok(entries);
            }
            entries.extend(page);
        }
    }
}

impl From<host_kv::KvError> for types::BrokerError {
    fn from(err: host_kv::KvError) -> Self {
        let detail = match err {
            host_kv::KvError::TooLarge(m) => format!("kv: too large: {m}"),
            host_kv::KvError::Invalid(m) => format!("kv: invalid: {m}"),
            host_kv::KvError::Storage(m) => format!("kv: storage: {m}"),
            host_kv::KvError::QuotaExceeded(m) => format!("kv: quota exceeded: {m}"),
        };
        types::BrokerError::Provider(detail)
    }
}

#[path = "../../fake/src/provider.rs"]
mod provider;

use published::Published;

export!(Published);
