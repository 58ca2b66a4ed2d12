//! The fake provider's source (`guests/fake/src/provider.rs`, unchanged)
//! built against `broker:provider@0.1.0` as published: the component a
//! third party built before 0.2.0, which the host serves as it is. This
//! crate stands in for the SDK the source names (`broker_guest`), with the
//! little of it the source uses, as 0.1.0 had it: no `claim-instance-id`
//! (a claim is then nothing) and no `scan-page` (a scan is one call).

extern crate self as broker_guest;

wit_bindgen::generate!({
    path: "../../wit/0.1.0",
    world: "provider",
    additional_derives: [serde::Serialize, serde::Deserialize, PartialEq],
});

pub use broker::provider::context::CallContext;
pub use broker::provider::kv as host_kv;
pub use broker::provider::types;
pub use exports::broker::provider::instance_broker::Guest;

/// `kv.scan`, decoded: 0.1.0 answers it in one buffer.
pub mod kv {
    use crate::host_kv::{self, KvError};

    /// The next `[u32 LE length][bytes]` of `rest`, which moves past it.
    fn chunk<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], KvError> {
        let truncated = || KvError::Invalid("scan buffer is truncated".into());
        let current: &'a [u8] = rest;
        let len: [u8; 4] = current.get(..4).ok_or_else(truncated)?.try_into().map_err(|_| truncated())?;
        let len = u32::from_le_bytes(len) as usize;
        let bytes = current.get(4..4 + len).ok_or_else(truncated)?;
        *rest = &current[4 + len..];
        Ok(bytes)
    }

    pub fn scan(prefix: &str) -> Result<Vec<(String, Vec<u8>)>, KvError> {
        let packed = host_kv::scan(prefix)?;
        let mut entries = Vec::new();
        let mut rest = packed.as_slice();
        while !rest.is_empty() {
            let key = String::from_utf8(chunk(&mut rest)?.to_vec())
                .map_err(|_| KvError::Invalid("a non-UTF-8 key".into()))?;
            entries.push((key, chunk(&mut rest)?.to_vec()));
        }
        Ok(entries)
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

use provider::Fake;

export!(Fake);
