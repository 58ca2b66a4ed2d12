//! Helpers over the host `kv` import.

use crate::host_kv::{self, KvError};

/// Decode the packed buffer returned by `kv.scan`:
/// repeated `[u32 LE key len][key][u32 LE value len][value]`.
pub fn decode_scan(buf: &[u8]) -> Result<Vec<(String, Vec<u8>)>, KvError> {
    let mut entries = Vec::new();
    let mut rest = buf;
    while !rest.is_empty() {
        let (key, after_key) = take_chunk(rest)?;
        let (value, after_value) = take_chunk(after_key)?;
        let key = std::str::from_utf8(key).map_err(|_| KvError::Invalid("scan returned a non-UTF-8 key".into()))?;
        entries.push((key.to_owned(), value.to_vec()));
        rest = after_value;
    }
    Ok(entries)
}

fn take_chunk(buf: &[u8]) -> Result<(&[u8], &[u8]), KvError> {
    let truncated = || KvError::Invalid("scan buffer is truncated".into());
    let len_bytes: [u8; 4] = buf.get(..4).ok_or_else(truncated)?.try_into().map_err(|_| truncated())?;
    let len = u32::from_le_bytes(len_bytes) as usize;
    let chunk = buf.get(4..4 + len).ok_or_else(truncated)?;
    Ok((chunk, &buf[4 + len..]))
}

/// Every entry under `prefix`, decoded.
pub fn scan(prefix: &str) -> Result<Vec<(String, Vec<u8>)>, KvError> {
    decode_scan(&host_kv::scan(prefix)?)
}
