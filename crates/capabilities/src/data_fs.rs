//! A provider's data dir as a filesystem of its own, `data-mib` in size, so
//! the kernel holds the provider to it whoever writes (its guest through the
//! host, or its granted programs) and it can never fill the filesystem the
//! host's state lives on.
//!
//! Each provider's image is `DATA_DIR/data-images/<name>.ext4`, a sparse file:
//! it takes on disk what is written, up to `data-mib` and ext4's own few MiB.
//! The host mounts it (through a loop device) on `DATA_DIR/data/<name>` when
//! the provider loads, and detaches the mount when the host exits; a mount a
//! killed host left behind is used as it is. A data dir that already holds
//! files (a host from before `data-mib`) has them copied into the new
//! filesystem first. Mounting needs root, as the sandbox's users do.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Where the images are, beside `DATA_DIR/data`.
pub const DATA_IMAGES: &str = "data-images";

/// Nothing a provider wrote runs, as a device, a set-uid or any program;
/// what it deletes is given back to the host's filesystem (the image is sparse).
const MOUNT_OPTIONS: &str = "loop,nodev,nosuid,noexec,discard";

/// Smallest `data-mib`: ext4's journal and metadata need a few MiB.
pub const MIN_DATA_MIB: u64 = 16;

/// Why a provider's data filesystem could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum DataFsError {
    /// A file operation on the image or the mount point failed.
    #[error("cannot {action} {path} for provider {provider}'s data dir: {}", crate::error_text::cause_text(.cause))]
    Io {
        /// The provider.
        provider: String,
        /// What the host was doing.
        action: &'static str,
        /// The file or directory.
        path: String,
        /// The error.
        cause: std::io::Error,
    },
    /// Its files cannot move into a filesystem of its own while programs it
    /// started may still write them.
    #[error(
        "provider {provider}'s data dir holds files and it has {children} recorded child process(es) (VMs and the like) that may write them: they cannot move into a data dir of its own (data-mib) while those run; stop its instances or remove the provider, then load it again, or set data-mib = 0"
    )]
    Busy {
        /// The provider.
        provider: String,
        /// Its recorded children.
        children: usize,
    },
    /// `data-mib = 0` asks for no filesystem of its own, but the provider's
    /// files are in one: run without it, it would find its data dir empty.
    #[error(
        "provider {provider}'s files are in a data filesystem of its own ({image}), but its manifest sets data-mib = 0 (none): it would find its data dir empty. Set data-mib again, or move its files out (mount the image, copy them into the data dir, delete the image) first"
    )]
    HasImage {
        /// The provider.
        provider: String,
        /// Its image.
        image: String,
    },
    /// A tool (mkfs.ext4, mount, losetup, resize2fs, cp) failed or is missing.
    #[error(
        "cannot {action} for provider {provider}'s data dir: `{command}` {outcome} (a data dir of its own, data-mib, needs root and e2fsprogs; data-mib = 0 runs the provider without one)"
    )]
    Tool {
        /// The provider.
        provider: String,
        /// What the host was doing.
        action: &'static str,
        /// The command line.
        command: String,
        /// Its exit and what it printed, or why it could not run.
        outcome: String,
    },
}

/// The data filesystems this host mounted, detached when it exits.
pub struct DataFilesystems {
    images: PathBuf,
    /// Mount points this host made or found; also serialises mounting.
    mounted: Mutex<Vec<PathBuf>>,
}

impl DataFilesystems {
    /// Images live in `images` (`DATA_DIR/data-images`).
    pub fn new(images: PathBuf) -> DataFilesystems {
        DataFilesystems { images, mounted: Mutex::default() }
    }

    /// Refuse to run `provider` without a filesystem of its own (`data-mib = 0`)
    /// when its files are in one.
    pub fn check_none(&self, provider: &str) -> Result<(), DataFsError> {
        let image = self.images.join(format!("{provider}.ext4"));
        // Its files are in the image, or half-way into it (a move a crash cut short).
        match [image.clone(), aside(&image)].into_iter().find(|path| path.exists()) {
            Some(found) => {
                Err(DataFsError::HasImage { provider: provider.to_owned(), image: found.display().to_string() })
            }
            None => Ok(()),
        }
    }

    /// Make `data_dir` the mount of `provider`'s filesystem of `mib` MiB:
    /// the image made (and existing files moved in, unless any of its
    /// `children` may still write them) or grown as needed.
    pub fn mount(&self, provider: &str, data_dir: &Path, mib: u64, children: usize) -> Result<(), DataFsError> {
        let mut mounted = self.mounted.lock().unwrap_or_else(|p| p.into_inner());
        let image = self.images.join(format!("{provider}.ext4"));
        let wanted = mib << 20;
        let size = |image: &Path| std::fs::metadata(image).map(|m| m.len()).map_err(io(provider, "look at", image));
        if is_mount_point(data_dir).map_err(io(provider, "look at", data_dir))? {
            if !image.exists() {
                // The operator's own filesystem: theirs to size, never detached here.
                tracing::warn!(provider, path = %data_dir.display(),
                    "the data dir is a mount the host did not make: data-mib is not applied");
                return Ok(());
            }
            if size(&image)? < wanted {
                tracing::warn!(
                    provider,
                    data_mib = mib,
                    "data-mib was raised: the data dir's filesystem grows when it is next mounted (the host's next start)"
                );
            }
        } else {
            // Only root reads or writes the images: they hold all a provider keeps.
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.images).map_err(io(
                provider,
                "make",
                &self.images,
            ))?;
            // A move a crash cut short is taken up again: its files are aside.
            let moving_in = has_entries(data_dir).map_err(io(provider, "read", data_dir))? || aside(&image).exists();
            if moving_in && children > 0 {
                return Err(DataFsError::Busy { provider: provider.to_owned(), children });
            }
            let made = !image.exists();
            if made {
                make_image(provider, &image, wanted)?;
            } else if filesystem_bytes(provider, &image)? < wanted {
                grow(provider, &image, wanted)?;
            }
            if moving_in {
                move_in(provider, &image, data_dir, made)?;
            } else {
                mount_on(provider, &image, data_dir)?;
            }
            // mkfs's own directory: nothing of the provider's.
            let _ = std::fs::remove_dir(data_dir.join("lost+found"));
        }
        if !mounted.iter().any(|m| m == data_dir) {
            mounted.push(data_dir.to_owned());
        }
        if size(&image)? > wanted {
            tracing::warn!(
                provider,
                data_mib = mib,
                "data-mib was lowered: the data dir's filesystem keeps its size (shrinking is not supported)"
            );
        }
        Ok(())
    }
}

impl Drop for DataFilesystems {
    fn drop(&mut self) {
        let mounted = self.mounted.get_mut().unwrap_or_else(|p| p.into_inner());
        for path in mounted.drain(..) {
            // Detached, not unmounted: a child that outlives the host keeps
            // its view, and the loop device goes when the last user does.
            if let Err(e) = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH) {
                tracing::warn!(path = %path.display(), error = %e, "cannot detach a provider's data filesystem");
            }
        }
    }
}

/// What `action` on `path` failing means for `provider`'s data dir.
fn io(provider: &str, action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DataFsError {
    let (provider, path) = (provider.to_owned(), path.display().to_string());
    move |source| DataFsError::Io { provider, action, path, cause: source }
}

/// Whether `dir` is the root of a filesystem other than its parent's.
fn is_mount_point(dir: &Path) -> std::io::Result<bool> {
    let parent = dir.parent().unwrap_or(dir);
    Ok(std::fs::symlink_metadata(dir)?.dev() != std::fs::symlink_metadata(parent)?.dev())
}

fn has_entries(dir: &Path) -> std::io::Result<bool> {
    Ok(std::fs::read_dir(dir)?.next().is_some())
}

/// A sparse image of `bytes` with an empty ext4 (no reserved blocks, a
/// small journal), made under a temporary name so a crash leaves none half-made.
fn make_image(provider: &str, image: &Path, bytes: u64) -> Result<(), DataFsError> {
    let partial = image.with_extension("partial");
    // One a crash left half-made is nobody's.
    let _ = std::fs::remove_file(&partial);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .map_err(io(provider, "make", &partial))?;
    file.set_len(bytes).map_err(io(provider, "size", &partial))?;
    drop(file);
    let mut mkfs = Command::new(tool("mkfs.ext4"));
    mkfs.args(["-q", "-F", "-m", "0", "-J", "size=4", "-E", "root_owner=0:0"]).arg(&partial);
    if let Err(e) = run(provider, "make its filesystem", &mut mkfs) {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, image).map_err(io(provider, "name", &partial))
}

fn mount_on(provider: &str, image: &Path, dir: &Path) -> Result<(), DataFsError> {
    let mut mount = Command::new(tool("mount"));
    mount.args(["-o", MOUNT_OPTIONS]).arg(image).arg(dir);
    run(provider, "mount its filesystem", &mut mount).map(drop)
}

/// Move what `data_dir` holds into the image: the old tree is renamed aside
/// (so whatever still holds it writes there, not lost), the image mounted on
/// `data_dir`, the tree copied in and then removed. If it does not fit, all
/// is put back as it was (and an image `made` for it removed).
fn move_in(provider: &str, image: &Path, data_dir: &Path, made: bool) -> Result<(), DataFsError> {
    let aside = aside(image);
    if aside.exists() {
        // Taken up again: the host made `data_dir` anew, and nothing wrote it since.
        tracing::warn!(provider, path = %aside.display(), "moving a data dir's files into its filesystem again, after a crash");
        std::fs::remove_dir(data_dir).map_err(io(provider, "clear", data_dir))?;
    } else {
        std::fs::rename(data_dir, &aside).map_err(io(provider, "move aside", data_dir))?;
    }
    let put_back = || {
        let _ = nix::mount::umount2(data_dir, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(data_dir);
        let _ = std::fs::rename(&aside, data_dir);
        if made {
            let _ = std::fs::remove_file(image);
        }
    };
    let mut source = aside.as_os_str().to_owned();
    source.push("/.");
    let moved = std::fs::create_dir(data_dir)
        .map_err(io(provider, "make", data_dir))
        .and_then(|()| mount_on(provider, image, data_dir))
        // Links are copied as links, never followed.
        .and_then(|()| {
            run(provider, "copy its files in", Command::new(tool("cp")).arg("-a").arg(&source).arg(data_dir))
        });
    if let Err(e) = moved {
        put_back();
        return Err(e);
    }
    if let Err(e) = std::fs::remove_dir_all(&aside) {
        tracing::warn!(provider, path = %aside.display(), error = %e, "cannot remove the data dir's files copied into its filesystem");
    }
    tracing::info!(provider, path = %data_dir.display(), "moved the data dir's files into its own filesystem");
    Ok(())
}

/// Where a data dir's files wait while they move into its filesystem.
fn aside(image: &Path) -> PathBuf {
    image.with_extension("before-data-mib")
}

/// The size of the image's filesystem (not of the file, which a grow cut
/// short may have lengthened already).
fn filesystem_bytes(provider: &str, image: &Path) -> Result<u64, DataFsError> {
    let header = run(provider, "read its filesystem's size", Command::new(tool("dumpe2fs")).arg("-h").arg(image))?;
    let field = |name: &str| {
        header.lines().find_map(|line| line.strip_prefix(name)?.trim_start_matches(':').trim().parse::<u64>().ok())
    };
    match (field("Block count"), field("Block size")) {
        (Some(blocks), Some(size)) => Ok(blocks * size),
        _ => Err(DataFsError::Tool {
            provider: provider.to_owned(),
            action: "read its filesystem's size",
            command: format!("dumpe2fs -h {}", image.display()),
            outcome: "printed no block count and size".into(),
        }),
    }
}

/// Grow the unmounted image to `bytes`, its filesystem with it (checked
/// first, as resize2fs requires). Not while a loop device still holds it (a
/// child that outlived the host may write it): then later.
fn grow(provider: &str, image: &Path, bytes: u64) -> Result<(), DataFsError> {
    // A loop device let go of by a detach goes a moment later: wait that long.
    let mut attached = String::new();
    for _ in 0..30 {
        attached = run(provider, "look for its loop device", Command::new(tool("losetup")).arg("-j").arg(image))?;
        if attached.trim().is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    if !attached.trim().is_empty() {
        tracing::warn!(
            provider,
            "data-mib was raised, but the data dir's filesystem is still in use: it grows when it is not"
        );
        return Ok(());
    }
    // 1: it corrected something (it makes lost+found anew): fine.
    run_allowing(provider, "check its filesystem", Command::new(tool("e2fsck")).args(["-f", "-p"]).arg(image), &[1])?;
    let file = std::fs::OpenOptions::new().write(true).open(image).map_err(io(provider, "open", image))?;
    if file.metadata().map_err(io(provider, "look at", image))?.len() < bytes {
        file.set_len(bytes).map_err(io(provider, "grow", image))?;
    }
    drop(file);
    run(provider, "grow its filesystem", Command::new(tool("resize2fs")).arg(image))?;
    tracing::info!(provider, mib = bytes >> 20, "grew the data dir's filesystem");
    Ok(())
}

/// The tool's path: the system directories first, as the daemon's PATH may lack them.
fn tool(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Run `command` to its end; its stdout if it succeeded.
fn run(provider: &str, action: &'static str, command: &mut Command) -> Result<String, DataFsError> {
    run_allowing(provider, action, command, &[])
}

/// As [`run`], exit codes in `fine` counting as success too.
fn run_allowing(
    provider: &str,
    action: &'static str,
    command: &mut Command,
    fine: &[i32],
) -> Result<String, DataFsError> {
    let line = format!("{command:?}").replace('"', "");
    let failed =
        |outcome: String| DataFsError::Tool { provider: provider.to_owned(), action, command: line.clone(), outcome };
    let output = command.output().map_err(|e| failed(format!("could not run: {e}")))?;
    if !output.status.success() && !output.status.code().is_some_and(|code| fine.contains(&code)) {
        let said = String::from_utf8_lossy(&output.stderr);
        let said: String = said.trim().chars().take(512).collect();
        return Err(failed(format!("exited with {}: {said}", output.status)));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A directory for the test and a data dir in it; `None` (skipped) unless root.
    fn scratch() -> Option<(tempfile::TempDir, PathBuf)> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: mounting a data filesystem needs root");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().join("data/p");
        std::fs::create_dir_all(&data_dir).unwrap();
        Some((dir, data_dir))
    }

    /// Writes 1 MiB blocks to `path` until refused: how many were written, and the error.
    fn fill(path: &Path) -> (u64, std::io::Error) {
        let mut file = std::fs::File::create(path).unwrap();
        let block = vec![7u8; 1 << 20];
        let mut written = 0;
        loop {
            if let Err(e) = file.write_all(&block).and_then(|()| file.sync_data()) {
                return (written, e);
            }
            written += 1;
        }
    }

    #[test]
    fn a_data_dir_is_held_to_its_size_keeps_its_files_and_grows() {
        let Some((dir, data_dir)) = scratch() else { return };
        // Files from before data-mib are carried over.
        std::fs::write(data_dir.join("kept"), b"from before").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", data_dir.join("link")).unwrap();
        let filesystems = DataFilesystems::new(dir.path().join(DATA_IMAGES));
        filesystems.mount("p", &data_dir, 16, 0).unwrap();
        assert!(is_mount_point(&data_dir).unwrap());
        assert_eq!(std::fs::read(data_dir.join("kept")).unwrap(), b"from before");
        assert_eq!(std::fs::read_link(data_dir.join("link")).unwrap(), Path::new("/etc/passwd"));
        assert!(!data_dir.join("lost+found").exists());
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o777;
        let images = dir.path().join(DATA_IMAGES);
        assert_eq!((mode(&images), mode(&images.join("p.ext4"))), (0o700, 0o600), "only root reads the images");

        let (written, error) = fill(&data_dir.join("big"));
        assert_eq!(error.raw_os_error(), Some(nix::libc::ENOSPC), "{error}");
        assert!((8..=16).contains(&written), "{written} MiB in a 16 MiB data dir");
        // Mounting again (a hot swap) uses what is there, a larger size too.
        filesystems.mount("p", &data_dir, 48, 0).unwrap();
        std::fs::remove_file(data_dir.join("big")).unwrap();
        drop(filesystems);
        assert!(!is_mount_point(&data_dir).unwrap(), "detached when the host goes");
        assert!(!data_dir.join("kept").exists(), "the files live in the image");

        // The next host mounts the same image, grown: the files are there.
        let filesystems = DataFilesystems::new(dir.path().join(DATA_IMAGES));
        filesystems.mount("p", &data_dir, 48, 0).unwrap();
        assert_eq!(std::fs::read(data_dir.join("kept")).unwrap(), b"from before");
        let (written, _) = fill(&data_dir.join("big"));
        assert!((25..=48).contains(&written), "{written} MiB after growing to 48");
    }

    #[test]
    fn a_move_or_an_image_a_crash_cut_short_is_taken_up_again() {
        let Some((dir, data_dir)) = scratch() else { return };
        let images = dir.path().join(DATA_IMAGES);
        std::fs::create_dir_all(&images).unwrap();
        // Killed mid-mkfs: a half-made image under its temporary name.
        std::fs::write(images.join("p.partial"), b"half").unwrap();
        // Killed mid-move: the files aside, the data dir made anew (empty) by the next load.
        std::fs::create_dir_all(images.join("p.before-data-mib/sub")).unwrap();
        std::fs::write(images.join("p.before-data-mib/sub/kept"), b"moved").unwrap();
        let filesystems = DataFilesystems::new(images.clone());
        filesystems.mount("p", &data_dir, 16, 0).unwrap();
        assert!(is_mount_point(&data_dir).unwrap());
        assert_eq!(std::fs::read(data_dir.join("sub/kept")).unwrap(), b"moved");
        assert!(!images.join("p.before-data-mib").exists() && !images.join("p.partial").exists());
    }

    #[test]
    fn files_that_do_not_fit_are_refused_and_left_where_they_were() {
        let Some((dir, data_dir)) = scratch() else { return };
        std::fs::write(data_dir.join("huge"), vec![1u8; 20 << 20]).unwrap();
        let filesystems = DataFilesystems::new(dir.path().join(DATA_IMAGES));
        let err = filesystems.mount("p", &data_dir, 16, 0).unwrap_err();
        assert!(err.to_string().contains("copy its files in"), "{err}");
        assert!(!is_mount_point(&data_dir).unwrap());
        assert_eq!(std::fs::metadata(data_dir.join("huge")).unwrap().len(), 20 << 20);
        assert!(!dir.path().join(DATA_IMAGES).join("p.ext4").exists(), "the image made for it is gone");

        // Files, and a provider whose programs may still write them: not moved.
        let err = filesystems.mount("p", &data_dir, 64, 1).unwrap_err();
        assert!(matches!(err, DataFsError::Busy { children: 1, .. }), "{err}");
        assert!(!is_mount_point(&data_dir).unwrap());
    }

    /// `data-mib = 0` for a provider whose files are in an image (or half-way
    /// into one) is refused, naming the image; a provider without one runs.
    #[test]
    fn no_filesystem_is_refused_while_the_files_are_in_one() {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join(DATA_IMAGES);
        std::fs::create_dir_all(images.join("moving.before-data-mib")).unwrap();
        std::fs::write(images.join("p.ext4"), b"").unwrap();
        let filesystems = DataFilesystems::new(images);
        let err = filesystems.check_none("p").unwrap_err();
        assert!(matches!(err, DataFsError::HasImage { .. }) && err.to_string().contains("p.ext4"), "{err}");
        let err = filesystems.check_none("moving").unwrap_err();
        assert!(err.to_string().contains("moving.before-data-mib"), "{err}");
        filesystems.check_none("q").unwrap();
    }
}
