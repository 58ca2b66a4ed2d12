//! Where providers' data dirs are (`DATA_DIR/data/<name>`, apart from
//! everything the host loads: a guest can write its data dir, so a manifest or
//! component there would let it grant itself anything — the rule itself is
//! `manifest::check_loadable`), moving older hosts' data dirs out of the
//! watched providers dir, and pinning approved manifests at start-up.

use crate::manifest::Manifest;
use crate::store::{Event, EventKind, Store};
use std::path::{Path, PathBuf};

/// Providers' data dirs live in `DATA_DIR/data/<name>`: apart from every
/// directory the host loads manifests or components from.
pub(crate) const DATA_DIRS: &str = "data";

/// Data dirs used to be `DATA_DIR/providers/<name>`, inside the directory
/// `broker serve` watches for manifests. Move what a registered provider kept
/// there to `DATA_DIR/data/<name>`, leaving only its manifest and component.
pub(crate) fn move_out_of_providers_dir(store: &Store) {
    let providers = match store.providers() {
        Ok(providers) => providers,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list providers to move their data dirs");
            return;
        }
    };
    for record in providers {
        let old = store.data_dir().join("providers").join(&record.name);
        let new = store.data_dir().join(DATA_DIRS).join(&record.name);
        let is_dir = std::fs::symlink_metadata(&old).is_ok_and(|m| m.is_dir());
        if !is_dir || new.exists() {
            continue;
        }
        let mut keep = vec![PathBuf::from(&record.manifest)];
        if let Ok(manifest) = Manifest::load(Path::new(&record.manifest)) {
            keep.push(manifest.component);
        }
        match move_entries(&old, &new, &keep) {
            Ok(moved) => {
                tracing::info!(provider = %record.name, from = %old.display(), to = %new.display(), moved, "moved data dir");
                let mut event = Event::new(EventKind::DataDirMoved, &record.name);
                event.detail = format!("{} entries from {} to {}", moved, old.display(), new.display());
                let _ = store.append_event(&event).wait();
            }
            Err(e) => tracing::warn!(provider = %record.name, error = %e, "cannot move data dir"),
        }
    }
}

/// Records made before grants were pinned carry no approved manifest: pin the
/// manifest as it is at the first start that knows better, so from now on the
/// watcher and restarts refuse a widening of it.
pub(crate) fn pin_approved_manifests(store: &Store) {
    let Ok(providers) = store.providers() else { return };
    for mut record in providers.into_iter().filter(|r| r.approved_manifest.is_none()) {
        match Manifest::load_with_text(Path::new(&record.manifest)) {
            Ok((_, text)) => {
                record.approved_manifest = Some(text);
                // Hosts from before kept the data dir beside such a manifest, where
                // the provider could rewrite it: the operator is told to look.
                let old_data_dir = store.data_dir().join("providers").join(&record.name);
                let writable = Path::new(&record.manifest).starts_with(&old_data_dir);
                let mut event = Event::new(EventKind::ApprovedManifestPinned, &record.name);
                event.detail = format!(
                    "{} is now what grants are measured against{}",
                    record.manifest,
                    if writable {
                        "; the provider could write it before this version: review its [grants]"
                    } else {
                        ""
                    }
                );
                if let Err(e) = store.put_provider(&record, &event).wait() {
                    tracing::warn!(provider = %record.name, error = %e, "cannot pin the approved manifest");
                    continue;
                }
                tracing::warn!(provider = %record.name, manifest = %record.manifest, writable_before = writable,
                    "pinned the manifest as approved: review its grants");
            }
            Err(e) => tracing::warn!(provider = %record.name, error = %e, "cannot read the manifest to pin it"),
        }
    }
}

fn move_entries(old: &Path, new: &Path, keep: &[PathBuf]) -> std::io::Result<usize> {
    std::fs::create_dir_all(new)?;
    let mut moved = 0;
    for entry in std::fs::read_dir(old)? {
        let entry = entry?;
        if keep.iter().any(|k| *k == entry.path()) {
            continue;
        }
        // rename moves a link as a link: nothing is followed.
        std::fs::rename(entry.path(), new.join(entry.file_name()))?;
        moved += 1;
    }
    Ok(moved)
}
