//! Per-store resource limits that remember whether a guest hit them, so a
//! trap can be reported as "memory limit" rather than a bare trap.

use wasmtime::ResourceLimiter;

pub(crate) struct GuestLimiter {
    memory_bytes: usize,
    hit: Option<String>,
}

impl GuestLimiter {
    pub(crate) fn new(memory_bytes: usize) -> Self {
        GuestLimiter { memory_bytes, hit: None }
    }

    /// What limit was refused, if any, since the store was made.
    pub(crate) fn hit(&self) -> Option<&str> {
        self.hit.as_deref()
    }
}

/// Table elements any sane provider stays under.
const MAX_TABLE_ELEMENTS: usize = 100_000;

impl ResourceLimiter for GuestLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.hit = Some(format!(
                "memory limit of {} MiB (grow from {} to {} bytes refused)",
                self.memory_bytes >> 20,
                current,
                desired
            ));
            // Trap rather than return -1: a guest allocator would abort anyway,
            // and the trap carries the cause.
            return Err(wasmtime::format_err!("memory limit of {} MiB exceeded", self.memory_bytes >> 20));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > MAX_TABLE_ELEMENTS {
            self.hit = Some(format!("table limit of {MAX_TABLE_ELEMENTS} elements"));
            return Err(wasmtime::format_err!("table limit of {MAX_TABLE_ELEMENTS} elements exceeded"));
        }
        Ok(true)
    }
}
