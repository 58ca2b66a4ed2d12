//! Ids for clouds that assign their own (EC2's `i-…`, a GCE number): the
//! host must record an instance's id before anything of it exists
//! (`claim-instance-id`), but the cloud's id comes only with the answer that
//! made the instance. A crash between the two would leave an instance the
//! host never heard of. So the provider makes the id itself, claims it, and
//! has the cloud carry it:
//!
//! 1. `let id = cloud_ids::claim(ctx, "juju-ns")?;` — `<prefix>-<n>`, claimed
//!    with the host (durable before it answers).
//! 2. Ask the cloud with [`client_token`]`(&id)` as the request's idempotency
//!    token (EC2's `ClientToken`: asked again, it answers the same instance)
//!    and the tag [`ID_TAG`]` = id` on the instance.
//! 3. Once it answers, [`remember`]`(&id, &cloud_id)`.
//! 4. `stop-instances` and `maintain-instance` get the host's ids: map each
//!    with [`cloud_id`], else find it by the tag (a start cut short between 2
//!    and 3 has no mapping yet); `all-instances` answers each cloud instance
//!    under [`host_id`] of its tags (an instance without the tag is not one
//!    of the host's). Stopped: [`forget`].
//!
//! A host killed at any point restarts with the id recorded, and its
//! reconcile finds the instance by the id the listing gives it: adopted,
//! never orphaned.

use crate::types::BrokerError;
use crate::{CallContext, host_kv};

/// The tag that carries the host's id on the cloud's instance.
pub const ID_TAG: &str = "broker-instance-id";

/// Where the cloud's id of each host id is kept in kv.
const MAPPING: &str = "cloud-id/";

/// The longest idempotency token [`client_token`] makes (EC2 takes 64 ASCII characters).
pub const MAX_TOKEN_CHARS: usize = 64;

/// A new id `<prefix>-<n>` (n counted in kv under `cloud-id-seq`), claimed
/// with the host before anything is asked of the cloud.
pub fn claim(ctx: &CallContext, prefix: &str) -> Result<String, BrokerError> {
    let n = host_kv::increment("cloud-id-seq", 1)?;
    let id = format!("{prefix}-{n}");
    ctx.claim_instance_id(&id)?;
    Ok(id)
}

/// The idempotency token of a start of `id`: the id itself when it is at
/// most 64 printable ASCII characters, else a 47-character prefix and a
/// hash of the whole (the same id, the same token).
pub fn client_token(id: &str) -> String {
    let fits = id.len() <= MAX_TOKEN_CHARS && id.bytes().all(|b| b.is_ascii_graphic());
    if fits {
        return id.to_owned();
    }
    let prefix: String = id.chars().filter(char::is_ascii_alphanumeric).take(47).collect();
    format!("{prefix}-{:016x}", fnv1a(id.as_bytes()))
}

/// Keep the cloud's id of the host's `id`.
pub fn remember(id: &str, cloud_id: &str) -> Result<(), BrokerError> {
    Ok(host_kv::set(&format!("{MAPPING}{id}"), cloud_id.as_bytes())?)
}

/// The cloud's id of the host's `id`, if it was remembered.
pub fn cloud_id(id: &str) -> Result<Option<String>, BrokerError> {
    let kept = host_kv::get(&format!("{MAPPING}{id}"))?;
    Ok(kept.map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
}

/// Forget the mapping of a stopped instance.
pub fn forget(id: &str) -> Result<(), BrokerError> {
    host_kv::delete(&format!("{MAPPING}{id}"))?;
    Ok(())
}

/// The host's id of a cloud instance, from its tags; none: not the host's.
pub fn host_id<'a>(tags: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<&'a str> {
    tags.into_iter().find(|(key, value)| *key == ID_TAG && !value.is_empty()).map(|(_, value)| value)
}

/// FNV-1a, 64 bits: a stable spread of a long id, not a secret.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_the_id_when_it_fits_else_stable_and_bounded() {
        assert_eq!(client_token("juju-ns-7"), "juju-ns-7");
        let long = format!("juju-{}-machine-3", "n".repeat(80));
        let token = client_token(&long);
        assert!(token.len() <= MAX_TOKEN_CHARS && token.is_ascii(), "{token}");
        assert_eq!(token, client_token(&long), "the same id, the same token");
        assert_ne!(token, client_token(&format!("{long}0")), "another id, another token");
        let odd = client_token("zone é/with space");
        assert!(odd.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'), "{odd}");
    }

    #[test]
    fn the_host_id_is_the_tag_and_an_untagged_instance_is_not_the_hosts() {
        let tags = [("Name", "web"), (ID_TAG, "juju-ns-7")];
        assert_eq!(host_id(tags.iter().copied()), Some("juju-ns-7"));
        assert_eq!(host_id([("Name", "web")]), None);
        assert_eq!(host_id([(ID_TAG, "")]), None);
    }
}
