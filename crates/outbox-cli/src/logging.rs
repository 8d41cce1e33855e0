//! Human-format logs that a row cannot tamper with.
//!
//! Log fields carry text that writers put in the outbox (`event_type`, `aggregate_id`, a sink's
//! error quoting a payload). Printed raw, an event type holding an escape sequence could clear an
//! operator's terminal, rewrite earlier lines or fake a log line; a newline could forge one.
//! [`SafeFields`] formats every field and the message like tracing's default formatter, with
//! every control character written as a `\u{…}` escape
//! ([`outbox_types::redact::escape_control`]). JSON logs need nothing: JSON escapes them.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::Writer;

/// A field formatter for the human log format that escapes control characters.
#[derive(Clone, Copy, Debug, Default)]
pub struct SafeFields;

impl<'a> MakeVisitor<Writer<'a>> for SafeFields {
    type Visitor = SafeVisitor<'a>;

    fn make_visitor(&self, writer: Writer<'a>) -> SafeVisitor<'a> {
        SafeVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
        }
    }
}

/// Writes `message` bare and every other field as `name=value`, separated by spaces.
pub struct SafeVisitor<'a> {
    writer: Writer<'a>,
    is_empty: bool,
    result: fmt::Result,
}

impl SafeVisitor<'_> {
    fn emit(&mut self, field: &Field, text: &str) {
        if self.result.is_err() {
            return;
        }
        if self.is_empty {
            self.is_empty = false;
        } else if let Err(e) = self.writer.write_char(' ') {
            self.result = Err(e);
            return;
        }
        let text = outbox_types::redact::escape_control(text);
        let name = field.name();
        self.result = match name {
            "message" => self.writer.write_str(&text),
            _ => write!(
                self.writer,
                "{}={text}",
                name.strip_prefix("r#").unwrap_or(name)
            ),
        };
    }
}

impl Visit for SafeVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.emit(field, value);
        } else {
            self.emit(field, &format!("{value:?}"));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.emit(field, &value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.emit(field, &format!("{value:?}"));
    }
}

impl VisitOutput<fmt::Result> for SafeVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for SafeVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_testkit::LogBuffer;

    #[test]
    fn control_characters_from_fields_and_messages_are_escaped() {
        let buffer = LogBuffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .fmt_fields(SafeFields)
            .with_writer(move || writer.clone())
            .finish();
        let evil = "Order\u{1b}[2J\u{1b}]0;owned\u{7}\nINFO forged line\u{9b}31m";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(event_type = %evil, plain = evil, error = ?evil, "Published {evil}.");
        });
        let out = buffer.text();
        let line = out.trim_end_matches('\n');
        assert!(!line.contains('\n'), "one line: {out:?}");
        assert!(!line.chars().any(char::is_control), "{out:?}");
        assert!(line.contains(r"event_type=Order\u{1b}[2J"), "{out}");
        assert!(line.contains("Published Order"), "{out}");
    }
}
