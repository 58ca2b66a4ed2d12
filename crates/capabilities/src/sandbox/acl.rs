//! POSIX ACL entries for a sandbox user, written as the kernel's xattr
//! (`system.posix_acl_access` / `system.posix_acl_default`) on file handles.
//!
//! Why ACLs: the guest writes its data dir through the host (as root) and its
//! granted programs write it as the provider's unprivileged user. A default
//! ACL on the data dir makes every file and directory either of them creates
//! there usable by that user, whoever made it, without chown races.
//!
//! Every handle is opened `O_NOFOLLOW` relative to its parent's handle, so a
//! link the guest planted is never followed to a file elsewhere.

use rustix::fs::{Mode, OFlags, XattrFlags};
use std::os::fd::{AsFd, OwnedFd};

const ACCESS: &str = "system.posix_acl_access";
const DEFAULT: &str = "system.posix_acl_default";
const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
const UNDEFINED_ID: u32 = u32::MAX;

pub(crate) const READ: u16 = 4;
pub(crate) const WRITE: u16 = 2;
pub(crate) const SEARCH: u16 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    tag: u16,
    id: u32,
    perm: u16,
}

fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    let (header, body) = bytes.split_first_chunk::<4>()?;
    if u32::from_le_bytes(*header) != VERSION || body.len() % 8 != 0 {
        return None;
    }
    Some(
        body.chunks_exact(8)
            .map(|c| Entry {
                tag: u16::from_le_bytes([c[0], c[1]]),
                perm: u16::from_le_bytes([c[2], c[3]]),
                id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect(),
    )
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = VERSION.to_le_bytes().to_vec();
    for e in entries {
        out.extend_from_slice(&e.tag.to_le_bytes());
        out.extend_from_slice(&e.perm.to_le_bytes());
        out.extend_from_slice(&e.id.to_le_bytes());
    }
    out
}

fn from_mode(mode: u32) -> Vec<Entry> {
    let bits = |shift: u32| ((mode >> shift) & 7) as u16;
    vec![
        Entry { tag: USER_OBJ, id: UNDEFINED_ID, perm: bits(6) },
        Entry { tag: GROUP_OBJ, id: UNDEFINED_ID, perm: bits(3) },
        Entry { tag: OTHER, id: UNDEFINED_ID, perm: bits(0) },
    ]
}

/// `entries` with `uid` given exactly `perm`, and a mask that lets it have
/// `perm`. Where there was a mask, only `perm`'s bits are added to it, and
/// other entries of the group class lose just those bits if the old mask
/// held them back: raising the mask for `uid` widens nobody else's rights.
/// Without one (a minimal ACL), the mask is the union of the group class, as
/// `setfacl -m` makes it.
fn with_user(mut entries: Vec<Entry>, uid: u32, perm: u16) -> Vec<Entry> {
    let old_mask = entries.iter().find(|e| e.tag == MASK).map(|e| e.perm);
    entries.retain(|e| !(e.tag == USER && e.id == uid) && e.tag != MASK);
    let mask = match old_mask {
        Some(old_mask) => {
            let opened = perm & !old_mask;
            for entry in entries.iter_mut().filter(|e| matches!(e.tag, USER | GROUP_OBJ | GROUP)) {
                entry.perm &= !opened;
            }
            old_mask | perm
        }
        None => entries.iter().filter(|e| matches!(e.tag, GROUP_OBJ | GROUP)).fold(perm, |m, e| m | e.perm),
    };
    entries.push(Entry { tag: USER, id: uid, perm });
    entries.push(Entry { tag: MASK, id: UNDEFINED_ID, perm: mask });
    entries.sort();
    entries
}

fn user_perm(entries: &[Entry], uid: u32) -> Option<u16> {
    let named = entries.iter().find(|e| e.tag == USER && e.id == uid)?.perm;
    let mask = entries.iter().find(|e| e.tag == MASK).map_or(7, |e| e.perm);
    Some(named & mask)
}

fn read_acl(fd: impl AsFd, name: &str, mode: u32) -> std::io::Result<Vec<Entry>> {
    let mut buf = vec![0u8; 1024];
    match rustix::fs::fgetxattr(&fd, name, &mut buf[..]) {
        Ok(n) => decode(&buf[..n]).ok_or_else(|| std::io::Error::other(format!("unreadable {name}"))),
        Err(rustix::io::Errno::NODATA) => Ok(from_mode(mode)),
        Err(e) => Err(e.into()),
    }
}

/// An ACL change reads the list, adds an entry and writes the list back:
/// two at once on one object (two providers given `/dev/net/tun`, or sharing
/// a granted path) would lose one's entry. This host's changes go one at a time.
static ACL_CHANGES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_change_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ACL_CHANGES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Give `uid` at least `perm` on the object behind `fd` (its access ACL).
pub fn grant(fd: impl AsFd, uid: u32, perm: u16) -> std::io::Result<()> {
    let _one = one_change_at_a_time();
    let stat = rustix::fs::fstat(&fd)?;
    let entries = read_acl(&fd, ACCESS, stat.st_mode)?;
    if user_perm(&entries, uid).is_some_and(|has| has & perm == perm) {
        return Ok(());
    }
    let had = entries.iter().find(|e| e.tag == USER && e.id == uid).map_or(0, |e| e.perm);
    rustix::fs::fsetxattr(&fd, ACCESS, &encode(&with_user(entries, uid, had | perm)), XattrFlags::empty())?;
    Ok(())
}

/// Make the object behind `fd` its owner's and its named users' alone: no
/// rights for its group or for others (named groups dropped), the mask (which
/// a minimal ACL's mode shows as the group bits) left as it is, so the
/// provider's own entry keeps working.
pub fn make_private(fd: impl AsFd) -> std::io::Result<()> {
    let _one = one_change_at_a_time();
    let stat = rustix::fs::fstat(&fd)?;
    let entries = read_acl(&fd, ACCESS, stat.st_mode)?;
    let exposed = entries.iter().any(|e| matches!(e.tag, GROUP_OBJ | GROUP | OTHER) && e.perm != 0);
    if !exposed {
        return Ok(());
    }
    if !entries.iter().any(|e| matches!(e.tag, USER | GROUP)) {
        // A minimal ACL is the mode itself.
        return Ok(rustix::fs::fchmod(&fd, Mode::from_raw_mode(stat.st_mode & 0o7700))?);
    }
    let mut entries: Vec<Entry> = entries.into_iter().filter(|e| e.tag != GROUP).collect();
    for entry in entries.iter_mut().filter(|e| matches!(e.tag, GROUP_OBJ | OTHER)) {
        entry.perm = 0;
    }
    rustix::fs::fsetxattr(&fd, ACCESS, &encode(&entries), XattrFlags::empty())?;
    Ok(())
}

/// Give `uid` read and write on a granted device node.
pub(crate) fn grant_device(node: impl AsFd, uid: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let _one = one_change_at_a_time();
    // The node the host opened (O_PATH) and checked, named through its
    // descriptor: no path is walked again, and the device is never opened.
    let path = format!("/proc/self/fd/{}", node.as_fd().as_raw_fd());
    let path = path.as_str();
    let stat = rustix::fs::fstat(&node)?;
    let mut buf = vec![0u8; 1024];
    let entries = match rustix::fs::getxattr(path, ACCESS, &mut buf[..]) {
        Ok(n) => decode(&buf[..n]).ok_or_else(|| std::io::Error::other(format!("unreadable {ACCESS}")))?,
        Err(rustix::io::Errno::NODATA) => from_mode(stat.st_mode),
        Err(e) => return Err(e.into()),
    };
    if user_perm(&entries, uid).is_some_and(|has| has & (READ | WRITE) == READ | WRITE) {
        return Ok(());
    }
    rustix::fs::setxattr(path, ACCESS, &encode(&with_user(entries, uid, READ | WRITE)), XattrFlags::empty())?;
    Ok(())
}

/// Give `uid` what it needs to run a granted program bound from outside
/// `/usr` (`file`, an `O_PATH` descriptor): read and execute.
pub(crate) fn grant_program(file: impl AsFd, uid: u32) -> std::io::Result<()> {
    grant(reopen(file)?, uid, READ | SEARCH)
}

/// Let `uid` search (not list) every directory above `path` that others
/// cannot search: bubblewrap, running as `uid`, must be able to reach what it
/// binds even by descriptor (the kernel checks the way to a mount's source).
/// Nothing of those directories becomes visible to the sandboxed program,
/// whose mount namespace has only what is bound. Each directory is opened
/// from `/` without following a link.
pub(crate) fn grant_search_to_ancestors(path: &std::path::Path, uid: u32) -> std::io::Result<()> {
    for dir in path.ancestors().skip(1) {
        let fd = match super::granted::open_unlinked(dir) {
            Ok(Some(fd)) => fd,
            Ok(None) => continue,
            Err(e) => return Err(std::io::Error::other(e.to_string())),
        };
        let stat = rustix::fs::fstat(&fd)?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::Directory
            && stat.st_mode & 0o001 == 0
        {
            grant(reopen(&fd)?, uid, SEARCH)?;
        }
    }
    Ok(())
}

/// Whether `uid` already has a default entry with `rwx` on the directory `fd`.
fn has_default(fd: impl AsFd, uid: u32) -> std::io::Result<bool> {
    let mut buf = vec![0u8; 1024];
    match rustix::fs::fgetxattr(&fd, DEFAULT, &mut buf[..]) {
        Ok(n) => Ok(decode(&buf[..n]).is_some_and(|e| user_perm(&e, uid) == Some(7))),
        Err(rustix::io::Errno::NODATA) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Make the directory `fd` and everything made in it later usable by `uid`:
/// `rwx` now, and a default ACL every new file and directory inherits.
fn share_dir(fd: impl AsFd, uid: u32) -> std::io::Result<()> {
    grant(&fd, uid, READ | WRITE | SEARCH)?;
    let _one = one_change_at_a_time();
    let stat = rustix::fs::fstat(&fd)?;
    // Another provider granted the same dir keeps its default entry: added to, not replaced.
    let mut default = read_acl(&fd, DEFAULT, stat.st_mode)?;
    for owner in default.iter_mut().filter(|e| e.tag == USER_OBJ) {
        owner.perm = 7; // the owner (root: the host writing for the guest) keeps rwx
    }
    rustix::fs::fsetxattr(&fd, DEFAULT, &encode(&with_user(default, uid, 7)), XattrFlags::empty())?;
    Ok(())
}

/// A usable descriptor of the object behind the `O_PATH` descriptor `opath`
/// (through `/proc/self/fd`, which names that object, not a path).
pub fn reopen(opath: impl AsFd) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    Ok(rustix::fs::open(format!("/proc/self/fd/{}", opath.as_fd().as_raw_fd()), flags, Mode::empty())?)
}

/// Share a provider's data dir (`dir`, an `O_PATH` descriptor) with its
/// sandbox user: the dir itself and, the first time (a data dir made before
/// confinement, or moved), everything already in it. Nothing below it is
/// followed through a link.
pub(crate) fn share_data_dir(dir: impl AsFd, uid: u32) -> std::io::Result<()> {
    let root = reopen(dir)?;
    if has_default(&root, uid)? {
        return grant(&root, uid, READ | WRITE | SEARCH);
    }
    share_tree(root, uid, 0)
}

/// Give `uid` what a grant of the operator's path (`top`, an `O_PATH`
/// descriptor opened without following links) says its programs may do:
/// read it (and what is below it), and for `paths-rw` write it too, with
/// default entries on its directories so what the programs make there stays
/// theirs to use. Done the first time: a path whose top already has the entry
/// is left as it is (under `paths`, files the operator adds later are as
/// readable as their mode makes them). Nothing below it is followed.
pub(crate) fn share_granted(top: impl AsFd, uid: u32, writable: bool) -> std::io::Result<()> {
    let stat = rustix::fs::fstat(&top)?;
    let (walk, perm) = match rustix::fs::FileType::from_raw_mode(stat.st_mode) {
        rustix::fs::FileType::Directory if writable => (Walk::Writable, READ | WRITE | SEARCH),
        rustix::fs::FileType::Directory => (Walk::Readable, READ | SEARCH),
        rustix::fs::FileType::RegularFile => {
            return grant(reopen(&top)?, uid, if writable { READ | WRITE } else { READ });
        }
        // Devices are granted as devices; sockets and FIFOs by their mode.
        _ => return Ok(()),
    };
    let top = reopen(&top)?;
    let done = read_acl(&top, ACCESS, stat.st_mode)?;
    if user_perm(&done, uid).is_some_and(|has| has & perm == perm) && (!writable || has_default(&top, uid)?) {
        return Ok(());
    }
    walk_tree(top, uid, walk, 0)
}

/// Take back every entry `uid` has on the object `fd` (access and default).
/// Without named entries left, the access ACL is the mode again.
/// Through `/proc/self/fd`, so `fd` may be an `O_PATH` descriptor: a device
/// node's entries are taken back without the host opening the device.
fn revoke(fd: impl AsFd, uid: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let object = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    let object = object.as_str();
    let _one = one_change_at_a_time();
    for name in [ACCESS, DEFAULT] {
        let mut buf = vec![0u8; 1024];
        let entries = match rustix::fs::getxattr(object, name, &mut buf[..]) {
            Ok(n) => decode(&buf[..n]).ok_or_else(|| std::io::Error::other(format!("unreadable {name}")))?,
            Err(rustix::io::Errno::NODATA | rustix::io::Errno::NOTSUP) => continue,
            Err(e) => return Err(e.into()),
        };
        if !entries.iter().any(|e| e.tag == USER && e.id == uid) {
            continue;
        }
        let mut kept: Vec<Entry> = entries.into_iter().filter(|e| !(e.tag == USER && e.id == uid)).collect();
        if !kept.iter().any(|e| matches!(e.tag, USER | GROUP)) {
            if name == DEFAULT && kept.iter().all(|e| e.tag != USER_OBJ || e.perm == 7) {
                // Only what sharing made (the owner's rwx and the mode's bits) is left.
                rustix::fs::removexattr(object, DEFAULT)?;
                continue;
            }
            // The mask was the group bits; without it the group's own entry is.
            let mask = kept.iter().find(|e| e.tag == MASK).map(|e| e.perm);
            kept.retain(|e| e.tag != MASK);
            if let (Some(mask), Some(group)) = (mask, kept.iter_mut().find(|e| e.tag == GROUP_OBJ)) {
                group.perm &= mask;
            }
        }
        rustix::fs::setxattr(object, name, &encode(&kept), XattrFlags::empty())?;
    }
    Ok(())
}

/// Take back what sharing gave `uid` on the tree at `top` (an `O_PATH`
/// descriptor) and on the directories above it (searches an older host
/// gave): a grant narrowed, or its provider removed. Follows no link.
pub fn unshare(top: impl AsFd, uid: u32, path: &std::path::Path) -> std::io::Result<()> {
    let stat = rustix::fs::fstat(&top)?;
    match rustix::fs::FileType::from_raw_mode(stat.st_mode) {
        rustix::fs::FileType::Directory => revoke_tree(reopen(&top)?, uid, 0)?,
        rustix::fs::FileType::RegularFile
        | rustix::fs::FileType::CharacterDevice
        | rustix::fs::FileType::BlockDevice => revoke(&top, uid)?,
        _ => {}
    }
    for dir in path.ancestors().skip(1) {
        if let Ok(Some(fd)) = super::granted::open_unlinked(dir) {
            revoke(&fd, uid)?;
        }
    }
    Ok(())
}

fn revoke_tree(dir: OwnedFd, uid: u32, depth: usize) -> std::io::Result<()> {
    revoke(&dir, uid)?;
    if depth >= MAX_DEPTH {
        return Ok(());
    }
    for name in entries_of(&dir)? {
        let Some(fd) = open_entry(&dir, &name)? else { continue };
        match rustix::fs::FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode) {
            rustix::fs::FileType::Directory => revoke_tree(fd, uid, depth + 1)?,
            rustix::fs::FileType::RegularFile => revoke(&fd, uid)?,
            _ => {}
        }
    }
    Ok(())
}

/// The entry `name` of `dir` itself, never what a link names; `None` for a
/// link, an entry gone meanwhile, or a FIFO or socket nobody serves.
fn open_entry(dir: &OwnedFd, name: &std::ffi::CStr) -> std::io::Result<Option<OwnedFd>> {
    // NONBLOCK: a FIFO is opened without waiting for a writer; NOFOLLOW: a link fails (ELOOP).
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    match rustix::fs::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOENT | rustix::io::Errno::NXIO) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn entries_of(dir: &OwnedFd) -> std::io::Result<Vec<std::ffi::CString>> {
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(entry.file_name().to_owned());
        }
    }
    Ok(names)
}

/// How a shared tree is given to the sandbox user.
#[derive(Clone, Copy)]
enum Walk {
    /// The data dir and `paths-rw`: read and write, and defaults for what is made later.
    Writable,
    /// `paths`: read.
    Readable,
}

/// Deeper than this, a tree the guest built to exhaust the walk is left as it is.
const MAX_DEPTH: usize = 64;

fn share_tree(dir: OwnedFd, uid: u32, depth: usize) -> std::io::Result<()> {
    walk_tree(dir, uid, Walk::Writable, depth)
}

fn walk_tree(dir: OwnedFd, uid: u32, walk: Walk, depth: usize) -> std::io::Result<()> {
    let device = rustix::fs::fstat(&dir)?.st_dev;
    walk_within(dir, uid, walk, depth, device)
}

/// The walk stays on the filesystem it started on (a mount below a grant is
/// not the grant), and leaves alone a file with more than one name: a hard
/// link a provider made there may name a file of anyone's elsewhere (where
/// `fs.protected_hardlinks` is off, even one it cannot read), and sharing it
/// would share that file.
fn walk_within(dir: OwnedFd, uid: u32, walk: Walk, depth: usize, device: u64) -> std::io::Result<()> {
    match walk {
        Walk::Writable => share_dir(&dir, uid)?,
        Walk::Readable => grant(&dir, uid, READ | SEARCH)?,
    }
    if depth >= MAX_DEPTH {
        return Ok(());
    }
    for name in entries_of(&dir)? {
        let Some(fd) = open_entry(&dir, &name)? else { continue };
        let stat = rustix::fs::fstat(&fd)?;
        if stat.st_dev != device {
            continue;
        }
        match (rustix::fs::FileType::from_raw_mode(stat.st_mode), walk) {
            (rustix::fs::FileType::Directory, _) => walk_within(fd, uid, walk, depth + 1, device)?,
            (rustix::fs::FileType::RegularFile, _) if stat.st_nlink > 1 => {}
            (rustix::fs::FileType::RegularFile, Walk::Writable) => grant(&fd, uid, READ | WRITE)?,
            (rustix::fs::FileType::RegularFile, Walk::Readable) => grant(&fd, uid, READ)?,
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn opened(path: &Path) -> OwnedFd {
        super::super::granted::open_unlinked(path).unwrap().unwrap()
    }

    #[test]
    fn a_hard_link_in_a_shared_tree_is_not_shared() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "root's").unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::hard_link(&secret, shared.join("linked")).unwrap();
        std::fs::write(shared.join("own"), "x").unwrap();
        share_granted(opened(&shared), 4242, true).unwrap();
        let perm = |path: &Path| {
            let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::NOFOLLOW, Mode::empty()).unwrap();
            let stat = rustix::fs::fstat(&fd).unwrap();
            user_perm(&read_acl(&fd, ACCESS, stat.st_mode).unwrap(), 4242)
        };
        assert_eq!(perm(&secret), None, "the file another name stands for was shared");
        assert_eq!(perm(&shared.join("own")), Some(READ | WRITE));
    }

    #[test]
    fn unsharing_takes_back_every_entry_of_the_user_and_no_one_elses() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("images");
        std::fs::create_dir_all(shared.join("sub")).unwrap();
        std::fs::write(shared.join("sub/file"), "x").unwrap();
        let mode_of = |path: &Path| std::fs::metadata(path).unwrap().permissions();
        let before = mode_of(&shared.join("sub/file"));
        share_granted(opened(&shared), 4242, true).unwrap();
        share_granted(opened(&shared), 4343, false).unwrap();
        let perm = |path: &Path, uid| {
            let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::NOFOLLOW, Mode::empty()).unwrap();
            let stat = rustix::fs::fstat(&fd).unwrap();
            user_perm(&read_acl(&fd, ACCESS, stat.st_mode).unwrap(), uid)
        };
        assert_eq!(perm(&shared.join("sub/file"), 4242), Some(READ | WRITE));
        unshare(opened(&shared), 4242, &shared).unwrap();
        for path in [shared.clone(), shared.join("sub"), shared.join("sub/file")] {
            assert_eq!(perm(&path, 4242), None, "{}", path.display());
            assert!(perm(&path, 4343).is_some(), "the other provider keeps its entry: {}", path.display());
        }
        unshare(opened(&shared), 4343, &shared).unwrap();
        assert_eq!(perm(&shared.join("sub/file"), 4343), None);
        assert_eq!(mode_of(&shared.join("sub/file")), before, "the mode is what it was");
        let fd = rustix::fs::open(&shared, OFlags::RDONLY, Mode::empty()).unwrap();
        assert!(!has_default(&fd, 4242).unwrap() && !has_default(&fd, 4343).unwrap());
    }

    #[test]
    fn entries_round_trip_and_the_mask_covers_the_group_class() {
        let entries = with_user(from_mode(0o750), 4242, READ | SEARCH);
        assert_eq!(decode(&encode(&entries)).unwrap(), entries);
        assert_eq!(user_perm(&entries, 4242), Some(READ | SEARCH));
        assert_eq!(user_perm(&entries, 4243), None);
        let mask = entries.iter().find(|e| e.tag == MASK).unwrap().perm;
        assert_eq!(mask, READ | SEARCH, "group r-x and the user r-x");
        assert!(entries.windows(2).all(|w| w[0] < w[1]), "the kernel wants entries sorted");
    }

    #[test]
    fn raising_the_mask_for_the_sandbox_user_widens_no_one_else() {
        // user 1000 rwx and group staff rw-, both held to r-- by the mask.
        let mut entries = from_mode(0o740);
        entries.push(Entry { tag: USER, id: 1000, perm: 7 });
        entries.push(Entry { tag: GROUP, id: 50, perm: READ | WRITE });
        entries.push(Entry { tag: MASK, id: UNDEFINED_ID, perm: READ });
        entries.sort();
        let entries = with_user(entries, 4242, SEARCH);
        assert_eq!(user_perm(&entries, 4242), Some(SEARCH));
        assert_eq!(user_perm(&entries, 1000), Some(READ), "still what the old mask allowed");
        let group = entries.iter().find(|e| e.tag == GROUP && e.id == 50).unwrap().perm;
        let mask = entries.iter().find(|e| e.tag == MASK).unwrap().perm;
        assert_eq!(
            (group, mask),
            (READ | WRITE, READ | SEARCH),
            "only the opened bit is taken, the mask says the rest"
        );
        assert_eq!(group & mask, READ);
        let user = entries.iter().find(|e| e.tag == USER && e.id == 1000).unwrap().perm;
        assert_eq!(user, READ | WRITE, "rwx lost only x, the bit the mask opened");
    }

    #[test]
    fn a_shared_dir_gives_the_user_what_is_made_in_it_later_but_follows_no_link() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "x").unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(data.join("old")).unwrap();
        std::fs::write(data.join("old/file"), "y").unwrap();
        std::os::unix::fs::symlink(&outside, data.join("link")).unwrap();
        share_data_dir(opened(&data), 4242).unwrap();

        let perm_of = |path: &Path| {
            let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::NOFOLLOW, Mode::empty()).unwrap();
            let stat = rustix::fs::fstat(&fd).unwrap();
            user_perm(&read_acl(&fd, ACCESS, stat.st_mode).unwrap(), 4242)
        };
        assert_eq!(perm_of(&data), Some(7));
        assert_eq!(perm_of(&data.join("old")), Some(7), "a dir made before is shared too");
        assert_eq!(perm_of(&data.join("old/file")), Some(READ | WRITE));
        assert_eq!(perm_of(&outside), None, "the link was not followed");
        std::fs::create_dir(data.join("new")).unwrap();
        std::fs::write(data.join("new/file"), "z").unwrap();
        assert_eq!(perm_of(&data.join("new")), Some(7), "inherited from the default ACL");
        assert_eq!(perm_of(&data.join("new/file")), Some(READ | WRITE));
    }

    #[test]
    fn providers_given_one_object_at_once_each_keep_their_entry() {
        let dir = tempfile::tempdir().unwrap();
        let uids: Vec<u32> = (0..8).map(|n| 50_000 + n).collect();
        for round in 0..50 {
            // A fresh object each round: every grant writes (none finds its entry there already).
            let object = dir.path().join(format!("object-{round}"));
            std::fs::write(&object, "x").unwrap();
            std::thread::scope(|scope| {
                for &uid in &uids {
                    let object = &object;
                    scope.spawn(move || {
                        let fd = rustix::fs::open(object, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).unwrap();
                        grant(&fd, uid, READ).unwrap();
                    });
                }
            });
            let fd = rustix::fs::open(&object, OFlags::RDONLY, Mode::empty()).unwrap();
            let stat = rustix::fs::fstat(&fd).unwrap();
            let entries = read_acl(&fd, ACCESS, stat.st_mode).unwrap();
            for &uid in &uids {
                assert_eq!(user_perm(&entries, uid), Some(READ), "round {round}: uid {uid}'s entry was lost");
            }
        }
    }

    #[test]
    fn two_providers_granted_one_rw_dir_both_keep_their_default_entries() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("images");
        std::fs::create_dir(&shared).unwrap();
        share_granted(opened(&shared), 4242, true).unwrap();
        share_granted(opened(&shared), 4343, true).unwrap();
        let fd = rustix::fs::open(&shared, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        assert!(has_default(&fd, 4242).unwrap(), "the first provider's default entry was replaced");
        assert!(has_default(&fd, 4343).unwrap());
        // What is made there later is both providers' to use.
        std::fs::write(shared.join("new"), "x").unwrap();
        let file = rustix::fs::open(shared.join("new"), OFlags::RDONLY, Mode::empty()).unwrap();
        let stat = rustix::fs::fstat(&file).unwrap();
        let entries = read_acl(&file, ACCESS, stat.st_mode).unwrap();
        assert!(user_perm(&entries, 4242).is_some() && user_perm(&entries, 4343).is_some(), "{entries:?}");
    }

    #[test]
    fn a_private_dir_keeps_the_providers_entry_and_shuts_out_everyone_else() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let open = || rustix::fs::open(&data, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        rustix::fs::fchmod(open(), Mode::from_raw_mode(0o755)).unwrap();
        make_private(open()).unwrap();
        assert_eq!(rustix::fs::fstat(open()).unwrap().st_mode & 0o777, 0o700, "a minimal ACL is the mode");
        share_data_dir(opened(&data), 4242).unwrap();
        rustix::fs::fchmod(open(), Mode::from_raw_mode(0o775)).unwrap();
        make_private(open()).unwrap();
        let stat = rustix::fs::fstat(open()).unwrap();
        let entries = read_acl(open(), ACCESS, stat.st_mode).unwrap();
        assert_eq!(user_perm(&entries, 4242), Some(7), "the provider's entry still works: {entries:?}");
        for tag in [GROUP_OBJ, OTHER] {
            assert_eq!(entries.iter().find(|e| e.tag == tag).unwrap().perm, 0, "{entries:?}");
        }
    }
}
