//! Which provider made which network device (taps, veths, bridges made
//! through the `network-bridge` capability): written before the device is
//! made, so no crash leaves a device of a provider's that the host does not
//! know is its own (see [`broker_capabilities::network::owners`]).

use super::db::StateDb;
use super::{Store, db_error, writer};
use broker_capabilities::network::owners::{DeviceOwners, OwnedDevice, OwnersError};
use futures_util::future::BoxFuture;
use redb::{ReadableTable, TableDefinition};
use std::sync::Arc;

/// Device name -> its [`OwnedDevice`] record, as JSON.
pub(super) const DEVICE_OWNERS: TableDefinition<&str, &[u8]> = TableDefinition::new("device_owners");

/// The store's record of device owners.
pub(crate) struct RedbDeviceOwners {
    db: Arc<StateDb>,
    writer: Arc<writer::Writer>,
}

fn owners_error(err: impl std::fmt::Display) -> OwnersError {
    OwnersError(err.to_string())
}

fn decode(bytes: &[u8]) -> Result<OwnedDevice, OwnersError> {
    serde_json::from_slice(bytes).map_err(|e| OwnersError(format!("a corrupt record: {e}")))
}

impl RedbDeviceOwners {
    fn read<T>(
        &self,
        read: impl FnOnce(&redb::ReadOnlyTable<&'static str, &'static [u8]>) -> Result<T, OwnersError>,
        empty: T,
    ) -> Result<T, OwnersError> {
        let txn = self.db.begin_read().map_err(owners_error)?;
        match txn.open_table(DEVICE_OWNERS) {
            Ok(table) => read(&table),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(empty),
            Err(e) => Err(owners_error(e)),
        }
    }
}

impl DeviceOwners for RedbDeviceOwners {
    fn owner(&self, name: &str) -> Result<Option<OwnedDevice>, OwnersError> {
        self.read(|table| table.get(name).map_err(owners_error)?.map(|v| decode(v.value())).transpose(), None)
    }

    fn owned_by(&self, provider: &str) -> Result<Vec<(String, OwnedDevice)>, OwnersError> {
        self.read(
            |table| {
                let mut owned = Vec::new();
                for entry in table.iter().map_err(owners_error)? {
                    let (name, value) = entry.map_err(owners_error)?;
                    let record = decode(value.value())?;
                    if record.provider == provider {
                        owned.push((name.value().to_owned(), record));
                    }
                }
                Ok(owned)
            },
            Vec::new(),
        )
    }

    fn claim(
        &self,
        devices: Vec<(String, OwnedDevice)>,
    ) -> BoxFuture<'static, Result<Option<(String, String)>, OwnersError>> {
        let encoded: Result<Vec<(String, Vec<u8>, String)>, super::StoreError> = devices
            .iter()
            .map(|(name, record)| {
                super::encoded("device owner", record).map(|b| (name.clone(), b, record.provider.clone()))
            })
            .collect();
        let pending = super::Pending::new(&self.writer, move |txn| {
            let encoded = encoded.as_ref().map_err(Clone::clone)?;
            let mut table = txn.open_table(DEVICE_OWNERS).map_err(db_error)?;
            for (name, _, provider) in encoded {
                if let Some(had) = table.get(name.as_str()).map_err(db_error)? {
                    let had = decode(had.value()).map(|o| o.provider).unwrap_or_default();
                    if had != *provider {
                        return Ok(Some((name.clone(), had)));
                    }
                }
            }
            for (name, bytes, _) in encoded {
                table.insert(name.as_str(), bytes.as_slice()).map_err(db_error)?;
            }
            Ok(None)
        });
        Box::pin(async move { pending.await.map_err(owners_error) })
    }

    fn release(&self, provider: &str, names: Vec<String>) -> BoxFuture<'static, Result<(), OwnersError>> {
        let provider = provider.to_owned();
        let pending = super::Pending::new(&self.writer, move |txn| {
            let mut table = txn.open_table(DEVICE_OWNERS).map_err(db_error)?;
            for name in &names {
                let own = table
                    .get(name.as_str())
                    .map_err(db_error)?
                    .is_some_and(|had| decode(had.value()).is_ok_and(|o| o.provider == provider));
                if own {
                    table.remove(name.as_str()).map_err(db_error)?;
                }
            }
            Ok(())
        });
        Box::pin(async move { pending.await.map_err(owners_error) })
    }

    fn replace(
        &self,
        name: &str,
        was: &OwnedDevice,
        now: Option<OwnedDevice>,
    ) -> BoxFuture<'static, Result<bool, OwnersError>> {
        let name = name.to_owned();
        let was = was.clone();
        let now = now.map(|now| super::encoded("device owner", &now)).transpose();
        let pending = super::Pending::new(&self.writer, move |txn| {
            let now = now.as_ref().map_err(Clone::clone)?;
            let mut table = txn.open_table(DEVICE_OWNERS).map_err(db_error)?;
            let still = match table.get(name.as_str()).map_err(db_error)? {
                Some(had) => decode(had.value()).is_ok_and(|had| had == was),
                None => false,
            };
            if still {
                match now {
                    Some(bytes) => {
                        table.insert(name.as_str(), bytes.as_slice()).map_err(db_error)?;
                    }
                    None => {
                        table.remove(name.as_str()).map_err(db_error)?;
                    }
                }
            }
            Ok(still)
        });
        Box::pin(async move { pending.await.map_err(owners_error) })
    }

    fn all(&self) -> Result<Vec<(String, OwnedDevice)>, OwnersError> {
        self.read(
            |table| {
                let mut all = Vec::new();
                for entry in table.iter().map_err(owners_error)? {
                    let (name, value) = entry.map_err(owners_error)?;
                    // A corrupt record is kept (and refuses what it names) rather than dropped unseen.
                    if let Ok(record) = decode(value.value()) {
                        all.push((name.value().to_owned(), record));
                    }
                }
                Ok(all)
            },
            Vec::new(),
        )
    }
}

impl Store {
    /// The record of which provider made which network device.
    pub fn device_owners(&self) -> Arc<dyn DeviceOwners> {
        Arc::new(RedbDeviceOwners { db: self.db.clone(), writer: self.writer.clone() })
    }
}

#[cfg(test)]
mod tests {
    use broker_capabilities::network::owners::OwnedDevice;

    /// Records survive a reopen; a claim of another's name writes nothing.
    #[tokio::test]
    async fn device_owners_survive_a_reopen_and_a_claim_is_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::Store::open(dir.path()).unwrap();
        let owners = store.device_owners();
        assert_eq!(owners.owner("kt1").unwrap(), None);
        let veth = |p: &str, peer: &str| OwnedDevice::new(p, "veth", Some(peer));
        let pair = vec![("vh1".to_owned(), veth("kvm", "vh1p")), ("vh1p".to_owned(), veth("kvm", "vh1"))];
        assert_eq!(owners.claim(pair).await.unwrap(), None);
        let refused = owners
            .claim(vec![("kt9".into(), OwnedDevice::new("lxd", "tap", None)), ("vh1".into(), veth("lxd", "x"))])
            .await
            .unwrap();
        assert_eq!(refused, Some(("vh1".into(), "kvm".into())));
        drop((owners, store));
        let store = super::Store::open(dir.path()).unwrap();
        let owners = store.device_owners();
        assert_eq!(owners.owner("vh1p").unwrap(), Some(veth("kvm", "vh1")));
        assert_eq!(owners.owner("kt9").unwrap(), None);
        assert_eq!(owners.owned_by("kvm").unwrap().len(), 2);
        owners.release("lxd", vec!["vh1".into()]).await.unwrap();
        assert_eq!(owners.owned_by("kvm").unwrap().len(), 2, "another provider's release drops nothing");
        owners.release("kvm", vec!["vh1".into(), "vh1p".into()]).await.unwrap();
        assert!(owners.owned_by("kvm").unwrap().is_empty());
    }
}
