//! Starts and stops in flight, recorded before the provider is called: what
//! a restart needs to finish them after the host was killed mid-call.
//!
//! A *pending start* is written (durably) before `start-instance` of a
//! provider that acts outside the store, and gains the instance's id when the
//! guest claims it (`claim-instance-id`); the start's record replaces it in
//! one commit. A *stop mark* is written before `stop-instances` and goes with
//! the record. Each carries the *session* (one per opening of the store) that
//! wrote it: the state file is one process's at a time, so every entry of an
//! earlier session is a call that process never finished.

use super::{INSTANCES, Store, StoreError, db_error, decode, encoded};
use broker_capabilities::bindings::StartInstanceParams;
use redb::{ReadableTable, TableDefinition};

/// Key: (provider, start key) -> [`PendingStart`] as JSON.
pub(super) const STARTS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("starts");
/// Key: (provider, instance id) -> [`StopMark`] as JSON.
pub(super) const STOPPING: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("stopping");

/// A start the host has asked a provider for and not yet recorded.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PendingStart {
    /// The store session that asked.
    pub session: u64,
    /// When it was asked, RFC 3339, UTC.
    pub started: String,
    /// Juju's machine nonce from the params' instance config (empty if none).
    #[serde(default)]
    pub nonce: String,
    /// The id the guest claimed, once it has.
    #[serde(default)]
    pub claimed: Option<String>,
    /// The params it was asked with: the adopted record's, for `maintain-instance`.
    pub params: StartInstanceParams,
}

/// A stop the host has asked a provider for and not yet seen through.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct StopMark {
    /// The store session that asked.
    pub session: u64,
    /// When it was asked, RFC 3339, UTC.
    pub since: String,
}

impl Store {
    /// This opening of the store: what tells its own calls in flight from an earlier process's.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Record a start about to be asked of `provider`; returns its key.
    pub(crate) async fn put_pending_start(&self, provider: &str, start: &PendingStart) -> Result<String, StoreError> {
        let key = self.next_start_key();
        self.pending_start_write(provider, &key, start).await?;
        Ok(key)
    }

    /// As [`Store::put_pending_start`], waiting for nobody: what a start
    /// dropped mid-call leaves, written before anything the call's drop writes.
    pub(crate) fn put_pending_start_detached(&self, provider: &str, start: &PendingStart) {
        self.pending_start_write(provider, &self.next_start_key(), start).detach();
    }

    fn next_start_key(&self) -> String {
        let sequence = self.starts_made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{:016x}-{sequence:012}", self.session)
    }

    fn pending_start_write(&self, provider: &str, key: &str, start: &PendingStart) -> super::Pending<()> {
        let (provider, bytes, key) = (provider.to_owned(), encoded("pending start", start), key.to_owned());
        self.write(move |txn| {
            let bytes = bytes.as_ref().map_err(Clone::clone)?;
            let mut table = txn.open_table(STARTS).map_err(db_error)?;
            table.insert((provider.as_str(), key.as_str()), bytes.as_slice()).map_err(db_error)?;
            Ok(())
        })
    }

    /// Note the id the guest claimed for the start `key`; `false` if the start is not pending.
    pub(crate) async fn claim_pending_start(&self, provider: &str, key: &str, id: &str) -> Result<bool, StoreError> {
        let (provider, key, id) = (provider.to_owned(), key.to_owned(), id.to_owned());
        self.write(move |txn| {
            let mut table = txn.open_table(STARTS).map_err(db_error)?;
            let found = table.get((provider.as_str(), key.as_str())).map_err(db_error)?.map(|v| v.value().to_vec());
            let Some(found) = found else { return Ok(false) };
            let mut start: PendingStart = decode("pending start", &found)?;
            start.claimed = Some(id.clone());
            let bytes = encoded("pending start", &start)?;
            table.insert((provider.as_str(), key.as_str()), bytes.as_slice()).map_err(db_error)?;
            Ok(true)
        })
        .await
    }

    /// Forget a pending start (it failed, or was resolved).
    pub(crate) async fn remove_pending_start(&self, provider: &str, key: &str) -> Result<(), StoreError> {
        let (provider, key) = (provider.to_owned(), key.to_owned());
        self.write(move |txn| {
            txn.open_table(STARTS).map_err(db_error)?.remove((provider.as_str(), key.as_str())).map_err(db_error)?;
            Ok(())
        })
        .await
    }

    /// `provider`'s pending starts of earlier sessions: calls cut short by the end of their process.
    pub fn interrupted_starts(&self, provider: &str) -> Result<Vec<(String, PendingStart)>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(STARTS).map_err(db_error)?;
        let mut out = Vec::new();
        super::each_of_owner(&table, provider, |key, value| {
            match decode::<PendingStart>("pending start", value) {
                Ok(start) if start.session != self.session => out.push((key.to_owned(), start)),
                Ok(_) => {}
                // Unreadable, so never resolvable: dropped, and said.
                Err(error) => {
                    tracing::error!(provider, key, %error, "a pending start does not decode: it is dropped");
                    out.push((key.to_owned(), PendingStart::unreadable()));
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Mark `ids` (those recorded for `provider`) as being stopped.
    pub async fn mark_stopping(&self, provider: &str, ids: &[String]) -> Result<(), StoreError> {
        let mark = self.stop_mark();
        let (provider, ids) = (provider.to_owned(), ids.to_vec());
        self.write(move |txn| mark_stops(txn, &mark, &provider, &ids)).await
    }

    /// This session's stop mark, encoded.
    pub(super) fn stop_mark(&self) -> Result<Vec<u8>, StoreError> {
        encoded("stop mark", &StopMark { session: self.session, since: super::records::now_rfc3339() })
    }

    /// `provider`'s stop marks of earlier sessions: stops cut short by the end of their process.
    pub fn interrupted_stops(&self, provider: &str) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(STOPPING).map_err(db_error)?;
        let mut out = Vec::new();
        super::each_of_owner(&table, provider, |id, value| {
            // An unreadable mark still says a stop was asked.
            let session = decode::<StopMark>("stop mark", value).map_or(0, |mark| mark.session);
            if session != self.session {
                out.push(id.to_owned());
            }
            Ok(())
        })?;
        Ok(out)
    }
}

/// Mark `ids` (those recorded for `provider`) with `mark`, in `txn`.
pub(super) fn mark_stops(
    txn: &super::Txn<'_>,
    mark: &Result<Vec<u8>, StoreError>,
    provider: &str,
    ids: &[String],
) -> Result<(), StoreError> {
    let mark = mark.as_ref().map_err(Clone::clone)?;
    let records = txn.open_table(INSTANCES).map_err(db_error)?;
    let mut marks = txn.open_table(STOPPING).map_err(db_error)?;
    for id in ids {
        if records.get((provider, id.as_str())).map_err(db_error)?.is_some() {
            marks.insert((provider, id.as_str()), mark.as_slice()).map_err(db_error)?;
        }
    }
    Ok(())
}

impl PendingStart {
    /// What an undecodable entry resolves as: nothing claimed, nothing to adopt.
    fn unreadable() -> PendingStart {
        PendingStart {
            session: 0,
            started: String::new(),
            nonce: String::new(),
            claimed: None,
            params: broker_capabilities::contract::empty_params(),
        }
    }
}
