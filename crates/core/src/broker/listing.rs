//! The listing of instances a page at a time: each provider's own pages
//! (contract 0.3.0's paged `all-instances`) merged with a range of the
//! host's records, so a page costs what it holds however many instances
//! there are. Where the listing goes on from is a [`ListCursor`].
//!
//! The merge needs a provider's pages in id order (each page's ids above the
//! page before's, as the SDK's `kv_page` lists them), which it says with the
//! `describe` feature [`ID_ORDERED_PAGES`]: then a record up to a page's last
//! id that the page does not hold is one the provider does not list. A
//! provider that does not say so, or an older one that answers every
//! instance at once, has each page cut from its whole listing, as before.

use super::service::{Broker, BrokerServiceError, InstanceRecord};
use crate::providers::RegistryError;
use crate::store::records::{MAX_INSTANCE_ID_BYTES, instance_id_problem};
use crate::version::{MAX_CURSOR_BYTES, ProviderVersion};
use broker_capabilities::rooms::context::CallHooks;

/// Most records one page holds, whatever is asked.
pub const MAX_PAGE: usize = 10_000;

/// How many empty pages of a provider's (allowed, and not its last) one
/// page of the listing asks past before answering an empty page that says
/// where to go on from.
const EMPTY_PAGES_ASKED: usize = 8;

/// Where a listing of instances goes on from: the cursor the API's
/// `X-Next-After` gives and `after=` takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListCursor {
    /// The provider the listing is at (providers are listed in name order).
    pub provider: String,
    /// Its last id listed; none: from its first.
    pub after: Option<String>,
    /// Where the provider's own listing is at.
    pub at: ProviderAt,
    /// How many pages were asked of the provider so far in this listing: past
    /// three times its `max-records` and one, its listing would never end.
    pub pages: usize,
}

/// Where a provider's own listing is at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderAt {
    /// Its first page.
    First,
    /// The page its cursor names: what its page before answered as `next`,
    /// and that page's last id (the page named lists only ids above it).
    Next {
        /// The provider's cursor, opaque to the host.
        cursor: String,
        /// The last id of the page before; none if that page was empty.
        above: Option<String>,
    },
    /// Without a cursor of its own (an older provider, one that does not list
    /// in id order, or a cursor of the `PROVIDER/ID` form): the page is cut
    /// from its whole listing.
    Whole,
}

/// Why an `after` cursor was refused.
#[derive(Debug, thiserror::Error)]
#[error("after: {0} (pass back what X-Next-After gave)")]
pub struct CursorError(&'static str);

/// Marks the cursors this host makes (a provider's name never starts with it).
const CURSOR_PREFIX: &str = "~1.";
/// Longest cursor text taken: a provider's cursor, two ids and a name, as
/// JSON (a byte at worst six) in base64 (4 for 3), and the seal.
const MAX_CURSOR_TEXT: usize = (6 * (MAX_CURSOR_BYTES + 3 * MAX_INSTANCE_ID_BYTES) + 64) * 4 / 3 + 64;

/// A cursor as text: `[provider, after, cursor, above, kind, pages]`.
type CursorFields = (String, Option<String>, Option<String>, Option<String>, u8, usize);

/// Seals the cursors a host hands out, so that what it passes a provider as
/// the cursor of its next page is what that provider answered, never what
/// an API client made up (the contract promises the previous page's `next`).
/// A host's own: a cursor from before a restart is not taken as sealed.
pub struct CursorKey(ring::hmac::Key);

impl CursorKey {
    /// A new random key.
    pub fn new() -> CursorKey {
        let rng = ring::rand::SystemRandom::new();
        // The OS's randomness failing is no state this host can run in.
        CursorKey(ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng).expect("the OS's randomness"))
    }
}

impl Default for CursorKey {
    fn default() -> CursorKey {
        CursorKey::new()
    }
}

impl ListCursor {
    /// The start of `provider`'s part of the listing.
    pub fn first(provider: &str) -> ListCursor {
        ListCursor { provider: provider.to_owned(), after: None, at: ProviderAt::First, pages: 0 }
    }

    /// The cursor `text` names: one this host made, or `PROVIDER/ID` (the
    /// form of hosts before paging, and of `broker instance list --after`).
    /// One whose seal is not `key`'s (made before a restart, or made up) goes
    /// on after its id, cut from the provider's whole listing.
    pub fn parse(text: &str, key: &CursorKey) -> Result<ListCursor, CursorError> {
        if text.len() > MAX_CURSOR_TEXT {
            return Err(CursorError("longer than any cursor this host makes"));
        }
        let Some(sealed) = text.strip_prefix(CURSOR_PREFIX) else {
            let (provider, id) =
                text.split_once('/').ok_or(CursorError("a cursor is PROVIDER/ID or one this host made"))?;
            return Ok(ListCursor::whole_after(provider, Some(id.to_owned())));
        };
        let (encoded, seal) = sealed.split_once('.').ok_or(CursorError("not a cursor this host made"))?;
        let decode = |text: &str| data_encoding::BASE64URL_NOPAD.decode(text.as_bytes());
        let (bytes, seal) = match (decode(encoded), decode(seal)) {
            (Ok(bytes), Ok(seal)) => (bytes, seal),
            _ => return Err(CursorError("not base64")),
        };
        let (provider, after, cursor, above, kind, pages): CursorFields =
            serde_json::from_slice(&bytes).map_err(|_| CursorError("not a cursor this host made"))?;
        let id_too_long = |id: &Option<String>| id.as_ref().is_some_and(|id| id.len() > MAX_INSTANCE_ID_BYTES);
        if id_too_long(&after) || id_too_long(&above) || cursor.as_ref().is_some_and(|c| c.len() > MAX_CURSOR_BYTES) {
            return Err(CursorError("a part of it is longer than a cursor this host makes holds"));
        }
        if ring::hmac::verify(&key.0, &bytes, &seal).is_err() {
            return Ok(ListCursor::whole_after(&provider, after));
        }
        let at = match (kind, cursor) {
            (0, None) => ProviderAt::First,
            (1, Some(cursor)) => ProviderAt::Next { cursor, above },
            (2, None) => ProviderAt::Whole,
            _ => return Err(CursorError("not a cursor this host made")),
        };
        Ok(ListCursor { provider, after, at, pages })
    }

    /// As text, for `X-Next-After`, sealed with `key`.
    pub fn to_text(&self, key: &CursorKey) -> String {
        let (kind, cursor, above) = match &self.at {
            ProviderAt::First => (0, None, None),
            ProviderAt::Next { cursor, above } => (1, Some(cursor.clone()), above.clone()),
            ProviderAt::Whole => (2, None, None),
        };
        let fields: CursorFields = (self.provider.clone(), self.after.clone(), cursor, above, kind, self.pages);
        // A tuple of strings and numbers always serializes.
        let json = serde_json::to_vec(&fields).unwrap_or_default();
        let seal = ring::hmac::sign(&key.0, &json);
        let encode = |bytes: &[u8]| data_encoding::BASE64URL_NOPAD.encode(bytes);
        format!("{CURSOR_PREFIX}{}.{}", encode(&json), encode(seal.as_ref()))
    }

    fn whole_after(provider: &str, after: Option<String>) -> ListCursor {
        ListCursor { provider: provider.to_owned(), after, at: ProviderAt::Whole, pages: 0 }
    }
}

/// One page of the listing, and where it goes on from if more may follow.
#[derive(Debug)]
pub struct InstancesPage {
    /// In order of provider, then id.
    pub records: Vec<InstanceRecord>,
    /// None: this page is the last.
    pub next: Option<ListCursor>,
}

impl Broker {
    /// What seals the cursors of this host's listing.
    pub fn cursor_key(&self) -> &CursorKey {
        &self.cursor_key
    }

    /// A page of the listing of instances, of at most `limit` records (1 to
    /// [`MAX_PAGE`]), from `from` (none: the first page): of provider `only`,
    /// or of every provider in name order. As [`Broker::list_instances`] does,
    /// listing every provider shows the records of one that fails to answer
    /// as `unknown`; asked for one provider, its failure is the answer.
    pub async fn instances_page(
        &self,
        only: Option<&str>,
        from: Option<ListCursor>,
        limit: usize,
    ) -> Result<InstancesPage, BrokerServiceError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let mut names: Vec<String> = match only {
            Some(name) => vec![name.to_owned()],
            None => self.registry().list()?.into_iter().map(|p| p.name).collect(),
        };
        names.sort_unstable();
        if let Some(from) = &from {
            names.retain(|name| *name >= from.provider);
        }
        let mut records = Vec::new();
        let mut from = from;
        for (at, name) in names.iter().enumerate() {
            let cursor = match from.take() {
                Some(cursor) if cursor.provider == *name => cursor,
                _ => ListCursor::first(name),
            };
            let room = limit - records.len();
            let part = match self.provider_part(name, &cursor, room).await {
                Ok(part) => part,
                Err(failed) if only.is_some() => return Err(failed),
                // Being removed: it has no recorded instances.
                Err(BrokerServiceError::Registry(RegistryError::Removing(_))) => continue,
                Err(failed) => self.unanswered_part(name, &cursor, room, &failed).await?,
            };
            records.extend(part.records);
            if part.next.is_some() {
                return Ok(InstancesPage { records, next: part.next });
            }
            if records.len() >= limit {
                let next = names.get(at + 1).map(|name| ListCursor::first(name));
                return Ok(InstancesPage { records, next });
            }
        }
        Ok(InstancesPage { records, next: None })
    }

    /// At most `room` of provider `name`'s part of the listing from `cursor`.
    async fn provider_part(&self, name: &str, cursor: &ListCursor, room: usize) -> Result<Part, BrokerServiceError> {
        let wasm = self.registry().get(name).await?;
        if cursor.at != ProviderAt::Whole && pages_in_id_order(&wasm).await {
            match self.paged_part(&wasm, name, cursor, room).await? {
                Paged::Part(part) => return Ok(part),
                Paged::Unmergeable(why) => {
                    tracing::warn!(
                        provider = name,
                        why,
                        "the listing cuts this provider's pages from its whole listing"
                    );
                }
            }
        }
        let all = self.provider_instances(name).await?;
        Ok(Part::cut(name, all, cursor.after.as_deref(), room))
    }

    /// The part the provider's own pages give, merged with the records of
    /// the ids they span.
    async fn paged_part(
        &self,
        wasm: &ProviderVersion,
        name: &str,
        cursor: &ListCursor,
        room: usize,
    ) -> Result<Paged, BrokerServiceError> {
        let hooks = CallHooks::default();
        let size = u32::try_from(room).unwrap_or(u32::MAX);
        let (mut at, mut after, mut pages) = (cursor.at.clone(), cursor.after.clone(), cursor.pages);
        let here = |after: Option<String>, at: &ProviderAt, pages: usize| ListCursor {
            provider: name.to_owned(),
            after,
            at: at.clone(),
            pages,
        };
        // An empty page that is not the last is allowed, endlessly not. Its
        // own pages are at most as many as the instances it may list, and one;
        // a page cut short is asked again, at most once per instance or record
        // shown: three times that, whatever the pages' sizes.
        let most_pages = wasm.manifest().limits.max_records.saturating_add(1).saturating_mul(3);
        for _ in 0..EMPTY_PAGES_ASKED {
            pages += 1;
            if pages > most_pages {
                return Err(BrokerServiceError::EndlessListing { provider: name.to_owned(), pages: most_pages });
            }
            let (asked, above) = match &at {
                ProviderAt::Next { cursor, above } => (Some(cursor.clone()), above.clone()),
                _ => (None, None),
            };
            // One more record than fits tells whether the page is cut.
            let (answer, window) =
                tokio::join!(wasm.instances_page(&hooks, asked, size), self.records_after(name, &after, room + 1));
            let (answer, window) = (answer?, window?);
            let ids = || answer.instances.iter().map(|listed| listed.instance.id.as_str());
            if !ids().zip(ids().skip(1)).all(|(a, b)| a < b) {
                return Ok(Paged::Unmergeable("a page of its listing is not in id order"));
            }
            if let (Some(above), Some(first)) = (&above, ids().next())
                && first <= above.as_str()
            {
                return Ok(Paged::Unmergeable("a page of its listing lists ids below the page before's"));
            }
            let next = match answer.next {
                Some(next) if wasm.redactor().redact(&next) != next => {
                    return Ok(Paged::Unmergeable("its cursor holds a secret's value"));
                }
                next => next,
            };
            // Up to the page's last id, the provider has listed all it has;
            // its last page lists all it has.
            let upto = match &next {
                Some(_) => ids().next_back().map(str::to_owned).or(above),
                None => None,
            };
            // That id goes in the cursor handed out: one the host would show.
            if let Some(upto) = &upto
                && (instance_id_problem(upto).is_some() || wasm.redactor().redact(upto) != *upto)
            {
                return Ok(Paged::Unmergeable("its page's last id is not one the host shows"));
            }
            let in_page = |id: &str| next.is_none() || upto.as_deref().is_some_and(|upto| id <= upto);
            let unlisted = |id: &str| after.as_deref().is_none_or(|after| id > after);
            let live = answer.instances.into_iter().filter(|listed| unlisted(&listed.instance.id)).collect();
            let records = window.into_iter().filter(|record| in_page(&record.id)).collect();
            let mut joined = self.joined(name, live, records)?;
            if joined.len() > room {
                // Cut: the next page asks the provider from the same place again.
                joined.truncate(room);
                let next = here(joined.last().map(|record| record.id.clone()), &at, pages);
                return Ok(Paged::Part(Part { records: joined, next: Some(next) }));
            }
            let Some(next) = next else { return Ok(Paged::Part(Part { records: joined, next: None })) };
            after = std::cmp::max(after, upto.clone());
            at = ProviderAt::Next { cursor: next, above: upto };
            if !joined.is_empty() {
                return Ok(Paged::Part(Part { records: joined, next: Some(here(after, &at, pages)) }));
            }
        }
        Ok(Paged::Part(Part { records: Vec::new(), next: Some(here(after, &at, pages)) }))
    }

    /// A provider that did not answer, in the listing of all: its records,
    /// `unknown`, with why; the next page asks it again.
    async fn unanswered_part(
        &self,
        name: &str,
        cursor: &ListCursor,
        room: usize,
        failed: &BrokerServiceError,
    ) -> Result<Part, BrokerServiceError> {
        let mut records = self.records_after(name, &cursor.after, room + 1).await?;
        let more = records.len() > room;
        records.truncate(room);
        Broker::unanswered(name, failed, &mut records);
        let next = more.then(|| ListCursor {
            provider: name.to_owned(),
            after: records.last().map(|record| record.id.clone()),
            at: cursor.at.clone(),
            pages: cursor.pages,
        });
        Ok(Part { records, next })
    }
}

/// The `describe` feature of a provider whose pages are in id order (the
/// guest SDK's `listing::ID_ORDERED_PAGES`).
pub const ID_ORDERED_PAGES: &str = "id-ordered-pages";

/// Whether `wasm` pages (0.3.0 on) and says its pages are in id order. A
/// provider that says so and does not garbles only its own part of the
/// listing (its word on its instances, which is its own to give anyway): each
/// record of the host's is shown once whatever it lists, and what is seen
/// out of order ends its paging.
async fn pages_in_id_order(wasm: &ProviderVersion) -> bool {
    wasm.lists_in_pages() && wasm.describe().await.is_ok_and(|info| info.features.iter().any(|f| f == ID_ORDERED_PAGES))
}

/// One provider's part of a page, and where its listing goes on from.
struct Part {
    records: Vec<InstanceRecord>,
    next: Option<ListCursor>,
}

impl Part {
    /// The part of a whole listing (in id order) after `after`.
    fn cut(name: &str, mut all: Vec<InstanceRecord>, after: Option<&str>, room: usize) -> Part {
        let from = after.map_or(0, |after| all.partition_point(|record| record.id.as_str() <= after));
        let mut records = all.split_off(from);
        let more = records.len() > room;
        records.truncate(room);
        let next = more.then(|| ListCursor::whole_after(name, records.last().map(|r| r.id.clone())));
        Part { records, next }
    }
}

/// What a provider's own pages gave.
enum Paged {
    Part(Part),
    /// They cannot be merged with the records a page at a time; why.
    Unmergeable(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next_at(cursor: &str) -> ListCursor {
        ListCursor {
            provider: "kvm".into(),
            after: Some("vm/7".into()),
            at: ProviderAt::Next { cursor: cursor.into(), above: Some("vm/7".into()) },
            pages: 3,
        }
    }

    #[test]
    fn a_cursor_reads_back_as_it_was_made() {
        let key = CursorKey::new();
        // The longest there is: every byte of the provider's cursor escaped in JSON.
        let longest = ListCursor {
            provider: "p".repeat(64),
            after: Some("a".repeat(MAX_INSTANCE_ID_BYTES)),
            at: ProviderAt::Next { cursor: "\u{1}".repeat(MAX_CURSOR_BYTES), above: Some("b".repeat(255)) },
            pages: usize::MAX,
        };
        let cursors = [
            ListCursor::first("fake"),
            next_at("instance/vm/7"),
            ListCursor::whole_after("lxd", Some("c1".into())),
            longest,
        ];
        for cursor in cursors {
            let text = cursor.to_text(&key);
            assert!(text.starts_with(CURSOR_PREFIX) && !text.contains(['/', '+', '=', ' ']), "{text:.80}");
            assert_eq!(ListCursor::parse(&text, &key).unwrap(), cursor);
        }
    }

    #[test]
    fn the_old_form_is_taken_and_cuts_from_the_whole_listing() {
        let cursor = ListCursor::parse("fake/fake-1/x", &CursorKey::new()).unwrap();
        assert_eq!(cursor, ListCursor::whole_after("fake", Some("fake-1/x".into())));
    }

    /// A provider is passed only the cursors it answered: one another key
    /// sealed (a host before a restart), or one made up, goes on after its
    /// id without it.
    #[test]
    fn a_cursor_this_host_did_not_seal_passes_no_cursor_to_the_provider() {
        let (key, other) = (CursorKey::new(), CursorKey::new());
        let cut = ListCursor::whole_after("kvm", Some("vm/7".into()));
        assert_eq!(ListCursor::parse(&next_at("x").to_text(&other), &key).unwrap(), cut);
        let sealed = next_at("instance/vm/7").to_text(&key);
        let (fields, seal) = sealed.rsplit_once('.').unwrap();
        let json = data_encoding::BASE64URL_NOPAD.decode(&fields.as_bytes()[CURSOR_PREFIX.len()..]).unwrap();
        let forged = String::from_utf8(json).unwrap().replace("instance/vm/7", "../../other");
        let forged = format!("{CURSOR_PREFIX}{}.{seal}", data_encoding::BASE64URL_NOPAD.encode(forged.as_bytes()));
        assert_eq!(ListCursor::parse(&forged, &key).unwrap(), cut);
    }

    #[test]
    fn a_cursor_the_host_did_not_make_is_refused() {
        let key = CursorKey::new();
        let made = |fields: &str| {
            let seal = ring::hmac::sign(&key.0, fields.as_bytes());
            let encode = |bytes: &[u8]| data_encoding::BASE64URL_NOPAD.encode(bytes);
            format!("{CURSOR_PREFIX}{}.{}", encode(fields.as_bytes()), encode(seal.as_ref()))
        };
        let long_id = "i".repeat(MAX_INSTANCE_ID_BYTES + 1);
        let refused = [
            "fake-1".to_owned(),
            format!("{CURSOR_PREFIX}not*base64.x"),
            format!("{CURSOR_PREFIX}bm8gc2VhbA"),
            made("{}"),
            made(r#"["fake",null,"c",null,0,0]"#),
            made(r#"["fake",null,null,null,1,0]"#),
            made(r#"["fake",null,null,null,9,0]"#),
            made(&format!(r#"["fake","{long_id}",null,null,0,0]"#)),
            made(&format!(r#"["fake",null,"{}",null,1,0]"#, "c".repeat(MAX_CURSOR_BYTES + 1))),
            format!("{CURSOR_PREFIX}{}", "A".repeat(MAX_CURSOR_TEXT)),
        ];
        for text in refused {
            assert!(ListCursor::parse(&text, &key).is_err(), "{text:.80}");
        }
    }
}
