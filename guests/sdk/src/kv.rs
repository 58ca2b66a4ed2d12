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

/// How much one page of [`scan`] asks the host for.
pub const SCAN_PAGE_BYTES: u32 = 4 << 20;

/// Every entry under `prefix`, decoded: read a page at a time, so a
/// namespace of any size (the guest's memory permitting) is read whole.
pub fn scan(prefix: &str) -> Result<Vec<(String, Vec<u8>)>, KvError> {
    let mut entries = Vec::new();
    scan_each(prefix, SCAN_PAGE_BYTES, |key, value| {
        entries.push((key, value));
        Ok(())
    })?;
    Ok(entries)
}

/// One page of the entries under `prefix` after `after` (none: from the
/// first), at most `max_bytes` packed but at least one entry; empty at the end.
pub fn scan_page(prefix: &str, after: Option<&str>, max_bytes: u32) -> Result<Vec<(String, Vec<u8>)>, KvError> {
    decode_scan(&host_kv::scan_page(prefix, after, max_bytes)?)
}

/// Every entry under `prefix` handed to `each` in key order, a page of
/// `page_bytes` at a time: only one page is held at once.
pub fn scan_each(
    prefix: &str,
    page_bytes: u32,
    mut each: impl FnMut(String, Vec<u8>) -> Result<(), KvError>,
) -> Result<(), KvError> {
    let mut after: Option<String> = None;
    loop {
        let page = scan_page(prefix, after.as_deref(), page_bytes)?;
        let Some((last, _)) = page.last() else { return Ok(()) };
        after = Some(last.clone());
        for (key, value) in page {
            each(key, value)?;
        }
    }
}

/// One entry of the namespace: its key and its value.
pub type Entry = (String, Vec<u8>);

/// At most `count` entries under `prefix` whose keys sort after `after`
/// (none: from the first), in key order, and whether any come after them:
/// a page of something kept one entry per key, read in pages about its size.
pub fn scan_count(prefix: &str, after: Option<&str>, count: usize) -> Result<(Vec<Entry>, bool), KvError> {
    // Pages of about what is wanted (`count` and one more, to tell whether
    // any follow): the host packs, and this unpacks, only what is used.
    let bytes_for = |entries: usize, each: usize| {
        u32::try_from(entries.saturating_mul(each)).unwrap_or(u32::MAX).clamp(4 << 10, SCAN_PAGE_BYTES)
    };
    let mut page_bytes = bytes_for(count + 1, 128);
    let (mut entries, mut packed) = (Vec::new(), 0usize);
    let mut cursor = after.map(str::to_owned);
    loop {
        let page = scan_page(prefix, cursor.as_deref(), page_bytes)?;
        let Some((last, _)) = page.last() else { return Ok((entries, false)) };
        cursor = Some(last.clone());
        for entry in page {
            if entries.len() == count {
                return Ok((entries, true));
            }
            packed += entry.0.len() + entry.1.len() + 8;
            entries.push(entry);
        }
        // Short: ask for the rest at the size seen so far, and a quarter more.
        let each = packed / entries.len().max(1) * 5 / 4;
        page_bytes = bytes_for(count + 1 - entries.len(), each);
    }
}

/// Compare-and-swap and transactions, as `host_kv` has them: see the WIT.
pub use crate::host_kv::{KvOp, delete_if_equal, set_if_absent, set_if_equal, transact};
