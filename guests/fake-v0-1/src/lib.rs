//! The fake provider's source (`guests/fake/src/provider.rs`, unchanged)
//! built against `broker:provider@0.1.0` as published: the component a
//! third party built before 0.2.0, which the host serves as it is. This
//! crate stands in for the SDK the source names (`broker_guest`), with the
//! little of it the source uses, as 0.1.0 had it: no `claim-instance-id`
//! (a claim is then nothing) and no `scan-page` (a scan is one call); its
//! listing is 0.1.0's, every instance in one answer (`published.rs`).

extern crate self as broker_guest;

wit_bindgen::generate!({
    path: "../../wit/0.1.0",
    world: "provider",
    additional_derives: [serde::Serialize, serde::Deserialize, PartialEq],
});

pub use broker::provider::context::CallContext;
pub use broker::provider::kv as host_kv;
pub use published::{Guest, listing, types};

mod published;

/// `kv.scan`, decoded: 0.1.0 answers it in one buffer.
pub mod kv {
    use crate::host_kv::KvError;

    pub fn scan(prefix: &str) -> Result<Vec<(String, Vec<u8>)>, KvError> {
        crate::published::unpack(&crate::host_kv::scan(prefix)?)
    }
}

impl CallContext {
    /// 0.1.0 has no claims: a start's id is the host's once it answers.
    pub fn claim_instance_id(&self, _id: &str) -> Result<(), types::BrokerError> {
        Ok(())
    }
}

impl From<host_kv::KvError> for types::BrokerError {
    fn from(err: host_kv::KvError) -> Self {
        let detail = match err {
            host_kv::KvError::TooLarge(m) => format!("kv: too large: {m}"),
            host_kv::KvError::Invalid(m) => format!("kv: invalid: {m}"),
            host_kv::KvError::Storage(m) => format!("kv: storage: {m}"),
        };
        types::BrokerError::Provider(detail)
    }
}

#[path = "../../fake/src/provider.rs"]
mod provider;

use published::Published;

export!(Published);
