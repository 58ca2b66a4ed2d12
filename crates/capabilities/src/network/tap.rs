//! Persistent tap devices for VMs, made as `ip tuntap add mode tap` makes them:
//! open `/dev/net/tun`, TUNSETIFF, TUNSETPERSIST, close. Netlink cannot create
//! taps, so this is the one place in the host with `unsafe`: two ioctls on an
//! fd we own with a buffer we own.
#![allow(unsafe_code)]

use super::{BridgeError, check_name};
use nix::libc::{c_int, c_ulong, ioctl};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;

/// `struct ifreq` as TUNSETIFF reads it: the name, the flags, and the rest of
/// the 24-byte union (40 bytes in all on 64-bit Linux).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct TunRequest {
    name: [u8; 16],
    flags: i16,
    rest: [u8; 22],
}

impl std::fmt::Debug for TunRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let end = self.name.iter().position(|&b| b == 0).unwrap_or(self.name.len());
        write!(f, "TunRequest({:?})", String::from_utf8_lossy(&self.name[..end]))
    }
}

pub(crate) const TUNSETIFF: c_ulong = 0x4004_54ca;
const TUNSETPERSIST: c_ulong = 0x4004_54cb;
const TUNSETOWNER: c_ulong = 0x4004_54cc;
const IFF_TAP: i16 = 0x0002;
const IFF_NO_PI: i16 = 0x1000;
const IFF_TUN_EXCL: i16 = 0x8000u16 as i16;
const IFF_VNET_HDR: i16 = 0x4000;

/// The request that attaches to the existing tap `name` as qemu's own tap
/// backend would (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`), made before a fork
/// so the child only hands it to the kernel. The kernel lets a caller
/// without `CAP_NET_ADMIN` attach only to a tap owned by its uid: made in the
/// child after it became the provider's user, the attach is the ownership check.
pub(crate) fn attach_request(name: &str) -> Result<TunRequest, BridgeError> {
    check_name(name)?;
    let mut request = TunRequest { name: [0; 16], flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR, rest: [0; 22] };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    Ok(request)
}

fn os_error(what: &str) -> BridgeError {
    BridgeError::Io { what: what.to_owned(), cause: std::io::Error::last_os_error() }
}

/// Make a persistent tap named `name` owned by `owner` (only that user may
/// then attach to it without privileges; 0 for root's). `exclusive`: fail
/// (EBUSY) if it exists, rather than take it over.
pub fn create_persistent_tap(name: &str, owner: u32, exclusive: bool) -> Result<(), BridgeError> {
    check_name(name)?;
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|source| BridgeError::Io { what: "open /dev/net/tun".into(), cause: source })?;
    let flags = IFF_TAP | IFF_NO_PI | if exclusive { IFF_TUN_EXCL } else { 0 };
    let mut request = TunRequest { name: [0; 16], flags, rest: [0; 22] };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: `tun` is an open /dev/net/tun for the whole call, and `request` is
    // a live, zero-padded, ifreq-sized buffer that the kernel reads and writes
    // within its 40 bytes.
    let rc: c_int = unsafe { ioctl(tun.as_raw_fd(), TUNSETIFF, &mut request as *mut TunRequest) };
    if rc < 0 {
        return Err(os_error("TUNSETIFF"));
    }
    // SAFETY: same fd; TUNSETPERSIST takes a plain integer argument.
    let rc: c_int = unsafe { ioctl(tun.as_raw_fd(), TUNSETPERSIST, 1 as c_ulong) };
    if rc < 0 {
        return Err(os_error("TUNSETPERSIST"));
    }
    // SAFETY: same fd; TUNSETOWNER takes a plain integer argument (the uid).
    let rc: c_int = unsafe { ioctl(tun.as_raw_fd(), TUNSETOWNER, owner as c_ulong) };
    if rc < 0 {
        return Err(os_error("TUNSETOWNER"));
    }
    // Closing the fd leaves the persistent device behind.
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_request_has_the_size_of_ifreq() {
        assert_eq!(std::mem::size_of::<super::TunRequest>(), 40);
    }
}
