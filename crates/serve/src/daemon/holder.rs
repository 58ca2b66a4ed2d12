//! Who holds a TCP address the daemon was asked to listen on: the listening
//! socket in `/proc/net/tcp{,6}` (its uid and inode), then the process with
//! that socket among its descriptors (`/proc/<pid>/fd`). For the refusal to
//! start: a program that took the `--listen` port while the daemon was down
//! would be sent the bearer tokens of clients meant for the daemon.

use broker_capabilities::error_text::escape_unprintable;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// The socket listening where the daemon would, and its process if found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    /// The address it listens on (the one asked for, or a wildcard covering it).
    pub(crate) local: SocketAddr,
    /// The socket's owner.
    pub(crate) uid: u32,
    /// The socket's inode.
    pub(crate) inode: u64,
    /// A process holding it, with its command line (escaped, cut).
    pub(crate) process: Option<(u32, String)>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.process {
            Some((pid, command)) => write!(f, "pid {pid} (uid {}, command `{command}`)", self.uid),
            None => write!(
                f,
                "a socket of uid {} on {} (inode {}; no process of this pid namespace holds it)",
                self.uid, self.local, self.inode
            ),
        }
    }
}

/// Most characters of a holder's command line shown.
const MAX_COMMAND_CHARS: usize = 200;

/// `cmdline`'s NUL-separated arguments as one line, each unprintable character
/// escaped (a command line is whatever its program chose), cut.
pub(crate) fn shown_command(cmdline: &[u8]) -> String {
    let text = String::from_utf8_lossy(cmdline);
    let joined = text.trim_end_matches('\0').replace('\0', " ");
    let escaped = escape_unprintable(&joined);
    let mut shown: String = escaped.chars().take(MAX_COMMAND_CHARS).collect();
    if escaped.chars().count() > MAX_COMMAND_CHARS {
        shown.push('…');
    }
    shown
}

/// The socket listening on `wanted` (or on the wildcard of its family, or
/// `::` covering IPv4), in this network namespace, and who holds it.
pub(crate) fn find(wanted: SocketAddr) -> Option<Holder> {
    find_in(Path::new("/proc"), wanted)
}

fn find_in(proc: &Path, wanted: SocketAddr) -> Option<Holder> {
    let (local, uid, inode) = ["net/tcp", "net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(proc.join(table)).ok())
        .flat_map(|text| text.lines().skip(1).filter_map(parse_listener).collect::<Vec<_>>())
        .find(|(local, _, _)| covers(*local, wanted))?;
    let process = process_of(proc, inode);
    Some(Holder { local, uid, inode, process })
}

/// Whether a socket listening on `local` keeps `wanted` from being bound.
fn covers(local: SocketAddr, wanted: SocketAddr) -> bool {
    if local.port() != wanted.port() {
        return false;
    }
    let local_ip = match local.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    local_ip == wanted.ip() || local_ip.is_unspecified() && (local_ip.is_ipv4() == wanted.is_ipv4() || local.is_ipv6())
}

/// One line of `/proc/net/tcp{,6}` in state LISTEN: its address, uid and inode.
fn parse_listener(line: &str) -> Option<(SocketAddr, u32, u64)> {
    const LISTEN: &str = "0A";
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 10 || fields[3] != LISTEN {
        return None;
    }
    let (address, port) = fields[1].split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // Each 32-bit word as the kernel holds it, printed in this host's byte order.
    let words: Option<Vec<[u8; 4]>> = (0..address.len() / 8)
        .map(|i| address.get(i * 8..i * 8 + 8).and_then(|w| u32::from_str_radix(w, 16).ok()).map(u32::to_ne_bytes))
        .collect();
    let bytes: Vec<u8> = words?.concat();
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes.as_slice()).ok()?)),
        _ => return None,
    };
    Some((SocketAddr::new(ip, port), fields[7].parse().ok()?, fields[9].parse().ok()?))
}

/// A process with socket `inode` among its descriptors, and its command line.
fn process_of(proc: &Path, inode: u64) -> Option<(u32, String)> {
    let target = format!("socket:[{inode}]");
    for entry in std::fs::read_dir(proc).ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        let holds =
            fds.flatten().any(|fd| std::fs::read_link(fd.path()).is_ok_and(|link| link.as_os_str() == &*target));
        if holds {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            return Some((pid, shown_command(&cmdline)));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_are_read_from_proc_net_tcp_lines() {
        // 127.0.0.1:8080 listening, uid 1000, inode 4242 (a little-endian host's words).
        let word = u32::from_ne_bytes([127, 0, 0, 1]);
        let line = format!(
            "   0: {word:08X}:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1"
        );
        let (local, uid, inode) = parse_listener(&line).unwrap();
        assert_eq!((local, uid, inode), ("127.0.0.1:8080".parse().unwrap(), 1000, 4242));
        let established = line.replace(" 0A ", " 01 ");
        assert_eq!(parse_listener(&established), None, "only listeners");
        let v6 = format!(
            "   0: {:08X}{:08X}{:08X}{:08X}:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1",
            0,
            0,
            0,
            u32::from_ne_bytes([0, 0, 0, 1])
        );
        assert_eq!(parse_listener(&v6).unwrap().0, "[::1]:8080".parse().unwrap());
    }

    #[test]
    fn a_wildcard_or_the_same_address_covers_the_wanted_one() {
        let wanted: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        for holding in ["127.0.0.1:8080", "0.0.0.0:8080", "[::]:8080", "[::ffff:127.0.0.1]:8080"] {
            assert!(covers(holding.parse().unwrap(), wanted), "{holding}");
        }
        for other in ["127.0.0.2:8080", "127.0.0.1:8081", "[::1]:8080"] {
            assert!(!covers(other.parse().unwrap(), wanted), "{other}");
        }
        assert!(covers("[::]:8080".parse().unwrap(), "[::1]:8080".parse().unwrap()));
        assert!(!covers("0.0.0.0:8080".parse().unwrap(), "[::1]:8080".parse().unwrap()));
    }

    #[test]
    fn a_holders_command_line_is_escaped_and_cut() {
        assert_eq!(shown_command(b"python3\0-m\0http.server\0"), "python3 -m http.server");
        assert_eq!(shown_command(b"evil\0\x1b[2J\nforged line\0"), "evil \\x1b[2J\\nforged line");
        assert_eq!(shown_command(&[b'a'; 300]).chars().count(), MAX_COMMAND_CHARS + 1);
    }

    /// A socket this test holds is found, with this process as its holder.
    #[test]
    fn the_holder_of_a_listening_socket_is_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let holder = find(addr).expect("the listener is found");
        assert_eq!(holder.local, addr);
        assert_eq!(holder.uid, rustix::process::getuid().as_raw());
        let (pid, _) = holder.process.clone().expect("its process is found");
        assert_eq!(pid, std::process::id());
        assert!(holder.to_string().starts_with(&format!("pid {pid} (uid ")), "{holder}");
        drop(listener);
        assert_eq!(find(addr), None, "nothing listens there now");
    }
}
