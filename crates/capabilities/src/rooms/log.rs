//! `broker:provider/log`: guest log lines become `tracing` events tagged with
//! the provider, at most `log-lines-per-second` of them over all its calls
//! and its stdout and stderr (a burst of ten seconds' worth passes); the rest
//! are counted and said as "suppressed N lines" with the next line written.

use crate::bindings::broker::provider::log::{self as wit, Level};
use crate::quotas::Quotas;
use crate::rooms::HasRooms;
use crate::rooms::{Linking, Room, StoreSetup};
use crate::secrets::Redactor;
use std::sync::Arc;
use wasmtime::component::{HasSelf, Linker};

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "log";

/// Longest message kept; the rest is cut so a guest cannot flood the logs with one line.
const MAX_MESSAGE_BYTES: usize = 4096;

/// Per-store context: the provider its lines are tagged with, and its bounds.
#[derive(Default)]
pub struct LogCtx {
    provider: Arc<str>,
    quotas: Arc<Quotas>,
    redactor: Arc<Redactor>,
}

impl LogCtx {
    pub(crate) fn new(provider: Arc<str>, quotas: Arc<Quotas>, redactor: Arc<Redactor>) -> Self {
        LogCtx { provider, quotas, redactor }
    }
}

impl wit::Host for LogCtx {
    async fn log(&mut self, level: Level, message: String) -> wasmtime::Result<()> {
        let provider = &*self.provider;
        if !self.quotas.log_line_allowed(provider) {
            return Ok(());
        }
        // Hidden before it is cut: a secret across the cut would leave a part.
        let redacted = self.redactor.redact(&message);
        let message = truncate(&redacted, MAX_MESSAGE_BYTES);
        match level {
            Level::Trace => tracing::trace!(provider, message, "guest log"),
            Level::Debug => tracing::debug!(provider, message, "guest log"),
            Level::Info => tracing::info!(provider, message, "guest log"),
            Level::Warn => tracing::warn!(provider, message, "guest log"),
            Level::Error => tracing::error!(provider, message, "guest log"),
        }
        Ok(())
    }
}

/// Cut `text` to at most `max` bytes on a character boundary.
pub fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut LogCtx,
) -> wasmtime::Result<()> {
    // The same in every contract version served: linked under each one's name.
    for instance in crate::bindings::served_instances(INTERFACE) {
        wit::add_to_linker_instance::<T, HasSelf<LogCtx>>(&mut linker.instance(&instance)?, getter)?;
    }
    Ok(())
}

/// The room: `log = true` under `[grants]`; linked only when granted.
pub struct Log;

impl Room for Log {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "log";
    const LINKING: Linking = Linking::WhenGranted;
    /// Lines go to the host's own log, cut short: nothing to inject or to seal.
    const REACHES_OUT: bool = false;
    type Grant = bool;
    type Backend = ();
    type Ctx = LogCtx;
    type Prepared = ();

    fn host_backend() -> Option<Arc<()>> {
        Some(Arc::new(()))
    }

    fn acts_outside_the_store(_: &bool) -> bool {
        false
    }

    fn ctx(_: &bool, _: Option<Arc<()>>, store: &StoreSetup<'_>) -> LogCtx {
        LogCtx::new(store.provider.clone(), store.quotas.clone(), store.redactor.clone())
    }

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state: &mut T| state.room::<Log>().0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("héllo", 3), "hé");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
