//! One line for an error and its causes, as the CLI prints it and the API
//! answers it. The host's errors name a cause once: either in their message
//! (`cannot read {path}: {}`, the cause's own text by [`cause_text`], and then
//! it is a field, not their `source()`), or as their `source()`, never both
//! (scripts/error-causes.py refuses both). Foreign errors may still repeat
//! a cause: one is added only when the text so far does not already say it. Text a provider chose is escaped
//! before a terminal shows it ([`escape_unprintable`]).

use std::borrow::Cow;
use std::error::Error;

/// Characters a terminal acts on rather than shows: C0 and C1 controls and DEL
/// (newline, carriage return, ESC, …), and the Unicode separators and bidi
/// controls that break or reorder a line, and the invisible ones (zero-width
/// spaces and joiners, fillers, variation selectors, tags, the byte-order
/// mark) that make two ids look alike.
pub fn is_unprintable(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00ad}'
                | '\u{034f}'
                | '\u{061c}'
                | '\u{115f}'
                | '\u{1160}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{3164}'
                | '\u{fe00}'..='\u{fe0f}'
                | '\u{feff}'
                | '\u{ffa0}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// `text` with each [unprintable](is_unprintable) character as a visible escape
/// (`\n`, `\r`, `\t`, `\x1b`, `\u{202e}`), for text a provider chose that a
/// terminal will show: it cannot forge lines, move the cursor or clear the screen.
pub fn escape_unprintable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unprintable) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_unprintable(c) && (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if is_unprintable(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `outer: cause: cause`, each cause once.
pub fn chain_text<'a>(chain: impl IntoIterator<Item = &'a (dyn Error + 'static)>) -> String {
    let mut text = String::new();
    for err in chain {
        let message = err.to_string();
        if text.is_empty() {
            text = message;
        } else if !message.is_empty() && !text.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
    }
    text
}

/// A cause as a message that names it says it: its text and its own causes',
/// each once (a message with this in it has no `source()` of its own).
pub fn cause_text(cause: &(dyn Error + 'static)) -> String {
    error_text(cause)
}

/// [`chain_text`] of `err` and its sources.
pub fn error_text(err: &(dyn Error + 'static)) -> String {
    chain_text(std::iter::successors(Some(err), |e: &&(dyn Error + 'static)| (*e).source()))
}

/// How the host's log writes an event's and its spans' fields: as
/// `tracing-subscriber`'s default does (`message name=value …`, strings
/// quoted), but with every value [escaped](escape_unprintable) — `%`
/// (Display) fields and the message included, which the default writes raw.
/// A provider's log message, error text, status, name or id therefore can
/// never start a line of its own (one without `provider=`) or drive the
/// terminal the log is read on, whichever call site forgot to escape it.
#[derive(Debug, Default, Clone, Copy)]
pub struct EscapedFields;

impl<'writer> tracing_subscriber::fmt::FormatFields<'writer> for EscapedFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = EscapingVisitor { writer, written: false, result: Ok(()) };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct EscapingVisitor<'writer> {
    writer: tracing_subscriber::fmt::format::Writer<'writer>,
    written: bool,
    result: std::fmt::Result,
}

impl EscapingVisitor<'_> {
    fn write(&mut self, text: &str) {
        if self.result.is_err() {
            return;
        }
        let separator = if self.written { " " } else { "" };
        self.written = true;
        self.result = write!(self.writer, "{separator}{}", escape_unprintable(text));
    }
}

impl tracing::field::Visit for EscapingVisitor<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "message" => self.write(value),
            name => self.write(&format!("{name}={value:?}")),
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.write(&format!("{value:?}")),
            // `log` crate records forwarded by tracing-log carry these; the formatter shows them.
            name if name.starts_with("log.") => {}
            name => self.write(&format!("{name}={value:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot read {path}: {}", crate::error_text::cause_text(.cause))]
        Quoting { path: String, cause: std::io::Error },
        #[error("cannot load")]
        Silent(#[source] std::io::Error),
    }

    #[test]
    fn a_cause_the_message_quotes_is_said_once_and_a_silent_one_is_added() {
        let missing = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let quoting = Outer::Quoting { path: "/x".into(), cause: missing() };
        assert_eq!(error_text(&quoting), "cannot read /x: no such file");
        assert_eq!(error_text(&Outer::Silent(missing())), "cannot load: no such file");
        let wrapped = anyhow::Error::new(quoting).context("cannot swap");
        assert_eq!(chain_text(wrapped.chain()), "cannot swap: cannot read /x: no such file");
    }

    #[test]
    fn unprintable_characters_are_escaped_and_the_rest_is_kept() {
        assert!(matches!(escape_unprintable("fake-0 ünï"), Cow::Borrowed("fake-0 ünï")));
        assert_eq!(escape_unprintable("a\x1b[2J\nb\r\tc"), "a\\x1b[2J\\nb\\r\\tc");
        assert_eq!(escape_unprintable("\0\x7f\u{85}\u{9b}"), "\\x00\\x7f\\x85\\x9b");
        assert_eq!(escape_unprintable("x\u{202e}y\u{2028}"), "x\\u{202e}y\\u{2028}");
        assert_eq!(escape_unprintable("a\u{200b}b\u{feff}"), "a\\u{200b}b\\u{feff}", "invisible, so lookalikes");
        let escaped = escape_unprintable("\x1b]0;title\x07\x1b[31m");
        assert!(!escaped.chars().any(is_unprintable), "{escaped}");
    }

    #[test]
    fn a_log_line_carries_no_control_character_a_field_brought() {
        #[derive(Clone, Default)]
        struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .fmt_fields(EscapedFields)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let forged = "ok\n2026-12-04T00:00:00Z  INFO forged: no provider\r\x1b[2K";
            let span = tracing::info_span!("call", provider = "hostile", id = %forged);
            let _in = span.enter();
            tracing::info!(provider = "hostile", message = forged, "guest log");
            tracing::warn!(provider = "hostile", line = %forged, "guest output");
            tracing::error!("{forged}");
        });
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        for line in text.lines() {
            assert!(!line.chars().any(is_unprintable), "{line:?}");
            assert!(line.contains("forged: no provider"), "the text is kept, escaped: {line}");
            assert!(line.contains("provider=\"hostile\""), "{line}");
        }
    }
}
