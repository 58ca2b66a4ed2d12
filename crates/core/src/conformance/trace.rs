//! Every host call a provider makes during a kit run, with its arguments and
//! result. The host bindings emit a `tracing` span per import call
//! (`wit-bindgen import`, with `module` and `function`) and inside it a `call`
//! event with the arguments and a `return` event with the result; the kit runs
//! its scenarios under a dispatcher of its own that turns those into lines.
//! Byte lists show as `...`, as the bindings print them.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// The longest a trace line gets; configs and ids can be long.
const MAX_LINE: usize = 240;

/// The host calls seen so far, oldest first.
#[derive(Debug, Default, Clone)]
pub(crate) struct HostCallLog(Arc<Mutex<Vec<String>>>, Arc<broker_capabilities::secrets::Redactor>);

impl HostCallLog {
    /// A log whose lines have the provider's secrets hidden before they are cut.
    pub(crate) fn redacting(redactor: Arc<broker_capabilities::secrets::Redactor>) -> HostCallLog {
        HostCallLog(Arc::default(), redactor)
    }

    /// A dispatcher that writes the host calls made under it to this log.
    pub(crate) fn dispatch(&self) -> tracing::Dispatch {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::Dispatch::new(tracing_subscriber::registry().with(Capture { log: self.clone() }))
    }

    /// The calls since the last take.
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn push(&self, line: String) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(line);
    }
}

struct Capture {
    log: HostCallLog,
}

/// An import call in flight: `module.function` and its arguments once seen.
struct ImportCall {
    name: String,
    args: String,
}

#[derive(Default)]
struct Fields {
    message: String,
    module: String,
    function: String,
    result: String,
    args: Vec<String>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "module" => self.module = value.to_owned(),
            "function" => self.function = value.to_owned(),
            _ => self.record_debug(field, &value),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "result" => self.result = format!("{value:?}"),
            // The resource a method is called on: its handle says nothing.
            "self_" => {}
            name => self.args.push(format!("{name}={value:?}")),
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "wit-bindgen import" {
            return;
        }
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            // `[method]call-context.aborted` reads better as `call-context.aborted`.
            let function = match fields.function.split_once(']') {
                Some(("[resource-drop", resource)) => format!("drop {resource}"),
                Some((_, function)) if fields.function.starts_with('[') => function.to_owned(),
                _ => fields.function,
            };
            let name = format!("{}.{function}", fields.module);
            span.extensions_mut().insert(ImportCall { name, args: String::new() });
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else { return };
        let mut extensions = span.extensions_mut();
        let Some(call) = extensions.get_mut::<ImportCall>() else { return };
        let mut fields = Fields::default();
        event.record(&mut fields);
        match fields.message.as_str() {
            "call" => call.args = fields.args.join(", "),
            "return" => {
                let line = format!("{}({}) -> {}", call.name, call.args, fields.result);
                // Hidden before it is cut: a secret across the cut would leave a part.
                let mut line = self.log.1.redact(&line).into_owned();
                if line.len() > MAX_LINE {
                    let cut = (0..=MAX_LINE).rev().find(|i| line.is_char_boundary(*i)).unwrap_or(0);
                    line.truncate(cut);
                    let _ = write!(line, "…");
                }
                self.log.push(line);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_import_span_with_call_and_return_events_is_one_line() {
        let log = HostCallLog::default();
        tracing::dispatcher::with_default(&log.dispatch(), || {
            let span = tracing::span!(tracing::Level::TRACE, "wit-bindgen import", module = "kv", function = "get");
            let _in = span.enter();
            tracing::event!(tracing::Level::TRACE, key = tracing::field::debug(&"fake/next"), "call");
            tracing::event!(tracing::Level::TRACE, result = tracing::field::debug(&Ok::<_, ()>(None::<u8>)), "return");
            tracing::event!(tracing::Level::TRACE, "other events in the span are not host calls");
            drop(_in);
            let function = "[method]call-context.aborted";
            let span = tracing::span!(tracing::Level::TRACE, "wit-bindgen import", module = "context", function);
            let _in = span.enter();
            tracing::event!(tracing::Level::TRACE, self_ = tracing::field::debug(&"Resource { rep: 0 }"), "call");
            tracing::event!(tracing::Level::TRACE, result = tracing::field::debug(&false), "return");
        });
        assert_eq!(log.take(), [r#"kv.get(key="fake/next") -> Ok(None)"#, "context.call-context.aborted() -> false"]);
        assert!(log.take().is_empty(), "taken once");
    }
}
