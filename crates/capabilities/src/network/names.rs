//! Juju's bridge names (`network.BridgeNameForDevice`), within Linux's
//! 15-character interface names.

/// `br-<dev>` for short names; `b-<dev>` at exactly 13; `b-<dev without en>` for
/// long `en*` names; else `b-<6 hex of crc32>-<last 6>`.
pub fn bridge_name(device: &str) -> String {
    let len = device.len();
    if len < 13 {
        format!("br-{device}")
    } else if len == 13 {
        format!("b-{device}")
    } else if let Some(rest) = device.strip_prefix("en") {
        format!("b-{rest}")
    } else {
        let hash = crc32fast::hash(device.as_bytes()) & 0x00ff_ffff;
        format!("b-{hash:06x}-{}", &device[len - 6..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jujus_bridge_names() {
        assert_eq!(bridge_name("eth0"), "br-eth0");
        assert_eq!(bridge_name("enp0s25"), "br-enp0s25");
        assert_eq!(bridge_name("twelve-chars"), "br-twelve-chars");
        assert_eq!(bridge_name("thirteen-char"), "b-thirteen-char");
        assert_eq!(bridge_name("enx00e07cc81e1d"), "b-x00e07cc81e1d");
        let long = bridge_name("some-very-long-device");
        assert!(long.starts_with("b-") && long.ends_with("-device"), "{long}");
        for device in ["eth0", "thirteen-char", "enx00e07cc81e1d", "some-very-long-device", "0123456789abcdefgh"] {
            assert!(bridge_name(device).len() <= 15, "{device} -> {}", bridge_name(device));
        }
    }
}
