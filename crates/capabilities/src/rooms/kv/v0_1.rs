//! `kv` as contract 0.1.0 published it, for components built against it:
//! the same calls on the same namespace, answered by the current `kv`
//! (0.2.0). Its `kv-error` has no `quota-exceeded`: a quota refusal reaches
//! an 0.1.0 component as `too-large` (what 0.1.0 said of a write the host
//! would not hold), its text naming the quota. 0.1.0 has no `scan-page`.

use super::KvCtx;
use crate::bindings::broker::provider::kv::{Host as Current, KvError};
use crate::bindings::v0_1::broker::provider::kv as published;
use wasmtime::component::{HasSelf, Linker};

type Answer<T> = wasmtime::Result<Result<T, published::KvError>>;

/// The current error as 0.1.0 spells it: the same case where there is one.
pub(crate) fn published_error(error: KvError) -> published::KvError {
    match error {
        KvError::TooLarge(why) => published::KvError::TooLarge(why),
        KvError::Invalid(why) => published::KvError::Invalid(why),
        KvError::Storage(why) => published::KvError::Storage(why),
        KvError::QuotaExceeded(why) => published::KvError::TooLarge(format!("quota exceeded: {why}")),
    }
}

impl published::Host for KvCtx {
    async fn get(&mut self, key: String) -> Answer<Option<Vec<u8>>> {
        Ok(Current::get(self, key).await?.map_err(published_error))
    }
    async fn set(&mut self, key: String, value: Vec<u8>) -> Answer<()> {
        Ok(Current::set(self, key, value).await?.map_err(published_error))
    }
    async fn delete(&mut self, key: String) -> Answer<bool> {
        Ok(Current::delete(self, key).await?.map_err(published_error))
    }
    async fn increment(&mut self, key: String, delta: i64) -> Answer<i64> {
        Ok(Current::increment(self, key, delta).await?.map_err(published_error))
    }
    async fn scan(&mut self, prefix: String) -> Answer<Vec<u8>> {
        Ok(Current::scan(self, prefix).await?.map_err(published_error))
    }
}

/// Link `broker:provider/kv@0.1.0` beside the current `kv`.
pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut KvCtx,
) -> wasmtime::Result<()> {
    published::add_to_linker::<T, HasSelf<KvCtx>>(linker, getter)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every current error has an 0.1.0 case, and a quota refusal says so.
    #[test]
    fn a_quota_refusal_reaches_a_published_component_as_too_large() {
        let refused = published_error(KvError::QuotaExceeded("kv-keys limit of 10".into()));
        assert_eq!(refused, published::KvError::TooLarge("quota exceeded: kv-keys limit of 10".into()));
        assert_eq!(published_error(KvError::Storage("disk".into())), published::KvError::Storage("disk".into()));
    }
}
