//! One way to print things that may hold a secret: URLs, configuration values, and text that
//! came from a row.
//!
//! A relay holds credentials for a database and for every destination, and its output — logs,
//! `outbox config check`, `last_error` in the table, `outbox status` — is read by more people
//! than those credentials are meant for. Every place that prints a URL or a secret goes through
//! this module, so a fix here is a fix everywhere:
//!
//! - [`redact_url`] masks the password of `user:password@` and the value of every query
//!   parameter whose name looks like a credential (`password`, `sslpassword`, `token`,
//!   `secret`, `key`, `sig`, …), in one URL or a comma-separated list of them;
//! - [`redact_in_text`] does the same to every URL found inside a longer text (a driver's error
//!   message that quotes the URL it failed to reach);
//! - [`is_secret_key`] says whether a configuration key names a credential (Kafka's
//!   `sasl.password`, `ssl.key.pem`, `sasl.oauthbearer.config`, …);
//! - [`Secret`] is a configuration value that prints as `***` through `Debug` and `Serialize`;
//! - [`escape_control`] makes text from a row safe to print on a terminal (an `event_type`
//!   holding an escape sequence could otherwise rewrite what an operator sees).
//!
//! ```
//! use outbox_types::redact::{redact_url, escape_control};
//! assert_eq!(
//!     redact_url("postgres://app:hunter2@db:5432/app?sslmode=require&password=x"),
//!     "postgres://app:***@db:5432/app?sslmode=require&password=***"
//! );
//! assert_eq!(escape_control("Order\u{1b}[2JCreated"), "Order\\u{1b}[2JCreated");
//! ```

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// What a masked value prints as.
pub const MASK: &str = "***";

/// Words that make a key (a query parameter, a client property) a credential. Matched against
/// the key in lower case, split at `.`, `_` and `-`: `sasl.password`, `ssl_key_password`,
/// `access-token`, `ssl.keystore.key`… but not `keepalive` or `keys_per_batch`.
const SECRET_WORDS: &[&str] = &[
    "password",
    "passwd",
    "pwd",
    "pass",
    "secret",
    "token",
    "key",
    "pem",
    "jaas",
    "credential",
    "credentials",
    "auth",
    "authorization",
    "sig",
    "signature",
    "apikey",
    "sslpassword",
    "nkey",
    "jwt",
    "seed",
];

/// Keys that are credentials although none of their words says so.
const SECRET_KEYS: &[&str] = &["sasl.oauthbearer.config", "sasl.kerberos.keytab"];

/// Whether a configuration key or URL query parameter names a credential, so its value must not
/// be printed.
///
/// ```
/// use outbox_types::redact::is_secret_key;
/// assert!(is_secret_key("sasl.password"));
/// assert!(is_secret_key("ssl.key.pem"));
/// assert!(is_secret_key("ssl.certificate.pem")); // PEM text inline: mask it all
/// assert!(is_secret_key("sasl.oauthbearer.config"));
/// assert!(is_secret_key("sslpassword"));
/// assert!(!is_secret_key("sslmode"));
/// assert!(!is_secret_key("keepalive"));
/// ```
pub fn is_secret_key(key: &str) -> bool {
    let lower = key.to_ascii_lowercase();
    if SECRET_KEYS.contains(&lower.as_str()) {
        return true;
    }
    lower
        .split(['.', '_', '-'])
        .any(|word| SECRET_WORDS.contains(&word))
}

/// `scheme://user:password@host/path?password=…` with the password and every credential-like
/// query value masked. A comma-separated list (`nats://a:p@h1:4222,nats://a:p@h2:4222`, Kafka
/// brokers) is masked item by item. Text that is not a URL comes back unchanged, except a bare
/// `user:password@host` (no scheme), whose password is masked too.
///
/// ```
/// use outbox_types::redact::redact_url;
/// assert_eq!(redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"), "amqp://guest:***@127.0.0.1:5672/%2f");
/// assert_eq!(redact_url("redis://:pw@127.0.0.1/0"), "redis://:***@127.0.0.1/0");
/// assert_eq!(redact_url("https://tok@hooks.example.com/x"), "https://***@hooks.example.com/x");
/// assert_eq!(redact_url("nats://a:p@h1,nats://a:p@h2"), "nats://a:***@h1,nats://a:***@h2");
/// assert_eq!(redact_url("https://h/x?sig=abc&id=7#top"), "https://h/x?sig=***&id=7#top");
/// assert_eq!(redact_url("events.${event_type}"), "events.${event_type}");
/// ```
pub fn redact_url(url: &str) -> String {
    if url.contains(',') {
        return url.split(',').map(redact_one).collect::<Vec<_>>().join(",");
    }
    redact_one(url).into_owned()
}

fn redact_one(url: &str) -> Cow<'_, str> {
    let (authority_start, has_scheme) = match url.find("://") {
        Some(i) => (i + 3, true),
        None => (0, false),
    };
    let rest = &url[authority_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..authority_start]);
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..colon]);
                    out.push(':');
                    out.push_str(MASK);
                }
                // A lone user part is a user name for databases and AMQP, a token for HTTP
                // and NATS (`https://TOKEN@host`, `nats://TOKEN@host`).
                None => {
                    let scheme = url[..authority_start.saturating_sub(3)].to_ascii_lowercase();
                    let names_a_user = matches!(
                        scheme.as_str(),
                        "postgres"
                            | "postgresql"
                            | "mysql"
                            | "mariadb"
                            | "amqp"
                            | "amqps"
                            | "redis"
                            | "rediss"
                            | "sqlite"
                    );
                    if names_a_user {
                        out.push_str(userinfo);
                    } else {
                        out.push_str(MASK);
                    }
                }
            }
            out.push_str(&authority[at..]);
        }
        None => out.push_str(authority),
    }
    let tail = &rest[authority_end..];
    if !has_scheme && !authority.contains('@') && !tail.contains('?') {
        return Cow::Borrowed(url);
    }
    match tail.find('?') {
        Some(q) => {
            out.push_str(&tail[..=q]);
            let query_and_fragment = &tail[q + 1..];
            let (query, fragment) = match query_and_fragment.find('#') {
                Some(h) => (&query_and_fragment[..h], &query_and_fragment[h..]),
                None => (query_and_fragment, ""),
            };
            let mut first = true;
            for pair in query.split('&') {
                if !first {
                    out.push('&');
                }
                first = false;
                match pair.split_once('=') {
                    Some((name, _)) if is_secret_key(name) => {
                        out.push_str(name);
                        out.push('=');
                        out.push_str(MASK);
                    }
                    _ => out.push_str(pair),
                }
            }
            out.push_str(fragment);
        }
        None => out.push_str(tail),
    }
    Cow::Owned(out)
}

/// Every URL inside `text` (a token that contains `://`) passed through [`redact_url`]; the
/// rest unchanged. For error messages from drivers and clients, which often quote the URL they
/// were given.
///
/// ```
/// use outbox_types::redact::redact_in_text;
/// assert_eq!(
///     redact_in_text("error sending request for url (https://u:pw@h/x): connection refused"),
///     "error sending request for url (https://u:***@h/x): connection refused"
/// );
/// ```
pub fn redact_in_text(text: &str) -> String {
    if !text.contains("://") && !text.contains('@') {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        if token.contains("://") {
            out.push_str(&redact_url(token));
        } else {
            out.push_str(token);
        }
        token.clear();
    };
    for c in text.chars() {
        if c.is_whitespace() || matches!(c, '(' | ')' | '"' | '\'' | '`' | '<' | '>' | '[' | ']') {
            flush(&mut token, &mut out);
            out.push(c);
        } else {
            token.push(c);
        }
    }
    flush(&mut token, &mut out);
    out
}

/// Serde helper: serialize a URL string through [`redact_url`]
/// (`#[serde(serialize_with = "outbox_types::redact::serialize_url")]`).
pub fn serialize_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url))
}

/// Serde helper for a list of URLs (`Vec<String>`), each through [`redact_url`].
pub fn serialize_url_list<S: serde::Serializer>(urls: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(urls.iter().map(|u| redact_url(u)))
}

/// Serde helper for `Option<String>` URLs.
pub fn serialize_optional_url<S: serde::Serializer>(
    url: &Option<String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match url {
        Some(url) => s.serialize_some(&redact_url(url)),
        None => s.serialize_none(),
    }
}

/// The warning a sink logs when it would send credentials without TLS, or `None`: `what` names
/// the credential (`the NATS password`), `url` where it goes (printed redacted), `fix` the
/// setting that turns TLS on.
///
/// ```
/// use outbox_types::redact::cleartext_warning;
/// let w = cleartext_warning("the Redis password", "redis://:pw@cache:6379", false, "`rediss://` or `tls = true`");
/// assert!(w.unwrap().contains("redis://:***@cache:6379"));
/// assert!(cleartext_warning("the Redis password", "rediss://cache", true, "").is_none());
/// ```
pub fn cleartext_warning(what: &str, url: &str, encrypted: bool, fix: &str) -> Option<String> {
    (!encrypted).then(|| {
        format!(
            "{what} goes to {} without TLS: anyone on the network path can read it; use {fix}",
            redact_url(url)
        )
    })
}

/// A secret read from configuration. Its `Debug` and `Serialize` print `***`, so a config that
/// is logged or printed (`outbox config check`) never shows it; [`Secret::expose`] is the one
/// way to read it.
///
/// ```
/// use outbox_types::redact::Secret;
/// let s: Secret = serde_json::from_str("\"hunter2\"").unwrap();
/// assert_eq!(s.expose(), "hunter2");
/// assert_eq!(format!("{s:?}"), "\"***\"");
/// assert_eq!(serde_json::to_string(&s).unwrap(), "\"***\"");
/// ```
#[derive(Clone, Deserialize, PartialEq, Eq, Default)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wrap a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value itself.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the value is empty (an empty secret is a configuration mistake).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(MASK)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{MASK}\"")
    }
}

/// `text` with every control character (C0, DEL, C1, and the bidirectional overrides that
/// reorder what a terminal shows) written as a `\u{…}` escape, and backslashes doubled only
/// where they would make an escape ambiguous. Text without such characters is borrowed as is.
///
/// ```
/// use outbox_types::redact::escape_control;
/// assert_eq!(escape_control("plain"), "plain");
/// assert_eq!(escape_control("a\nb\r\u{7}"), "a\\u{a}b\\u{d}\\u{7}");
/// assert_eq!(escape_control("rtl\u{202e}txt"), "rtl\\u{202e}txt");
/// ```
pub fn escape_control(text: &str) -> Cow<'_, str> {
    fn unsafe_char(c: char) -> bool {
        c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    }
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_in_userinfo_and_query_are_masked() {
        let cases = [
            ("postgres://u:p@h/db", "postgres://u:***@h/db"),
            (
                "postgres://u:secret@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("postgres://h/db", "postgres://h/db"),
            (
                "postgres://h/db?user=u&password=p",
                "postgres://h/db?user=u&password=***",
            ),
            (
                "postgres://h/db?sslpassword=p&sslmode=verify-full",
                "postgres://h/db?sslpassword=***&sslmode=verify-full",
            ),
            (
                "mysql://root:@127.0.0.1/test",
                "mysql://root:***@127.0.0.1/test",
            ),
            ("mysql://u:secret@h:3306/db", "mysql://u:***@h:3306/db"),
            ("mysql://u@h/db", "mysql://u@h/db"),
            ("mysql://h/db", "mysql://h/db"),
            ("sqlite://outbox.db?mode=rwc", "sqlite://outbox.db?mode=rwc"),
            ("u:p@host:4222", "u:***@host:4222"),
            ("nats://tok@host:4222", "nats://***@host:4222"),
            ("amqp://guest@h", "amqp://guest@h"),
            ("https://tok@h", "https://***@h"),
            (
                "https://h/p?access_token=x&q=1",
                "https://h/p?access_token=***&q=1",
            ),
            ("", ""),
            ("kafka-1:9092,kafka-2:9092", "kafka-1:9092,kafka-2:9092"),
            // An `@` in the password itself: the last `@` of the authority ends the userinfo.
            ("amqp://u:p@ss@h:5672/v", "amqp://u:***@h:5672/v"),
        ];
        for (input, expected) in cases {
            assert_eq!(redact_url(input), expected, "{input}");
        }
    }

    #[test]
    fn urls_inside_text_are_masked_and_the_rest_kept() {
        let text =
            "cannot connect to postgres://app:s3cr3t@db/app (timeout); retry \"nats://x:y@n\"";
        let out = redact_in_text(text);
        assert!(!out.contains("s3cr3t") && !out.contains(":y@"), "{out}");
        assert!(out.contains("(timeout); retry"), "{out}");
    }

    #[test]
    fn secret_keys() {
        for key in [
            "password",
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "ssl.key.pem",
            "ssl.certificate.pem",
            "ssl.ca.pem",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.client.secret",
            "sasl.jaas.config",
            "api_key",
            "x-api-key",
            "bearer_token",
            "credentials_file",
        ] {
            assert!(is_secret_key(key), "{key}");
        }
        for key in [
            "bootstrap.servers",
            "sslmode",
            "keepalive",
            "acks",
            "compression.type",
            "client.id",
        ] {
            assert!(!is_secret_key(key), "{key}");
        }
    }

    #[test]
    fn escapes_every_control_character() {
        for c in (0u32..0x20)
            .chain([0x7f, 0x85, 0x9b])
            .filter_map(char::from_u32)
        {
            let text = format!("a{c}b");
            let escaped = escape_control(&text);
            assert!(!escaped.chars().any(char::is_control), "{c:?}");
        }
    }
}
