//! One way to print things that may hold a secret: URLs, configuration values, and text that
//! came from a row.
//!
//! A relay holds credentials for a database and for every destination, and its output — logs,
//! `outbox config check`, `last_error` in the table, `outbox status` — is read by more people
//! than those credentials are meant for. Every place that prints a URL or a secret goes through
//! this module, so a fix here is a fix everywhere:
//!
//! - [`redact_url`] masks the password of `user:password@`, the value of every query
//!   parameter whose name looks like a credential (`password`, `sslpassword`, `token`,
//!   `accessToken`, `client_secret`, `X-Api-Key`, `sig`, … — see [`is_secret_key`]), and, in
//!   `http(s)://` and `ws(s)://` URLs, the path segments that carry a credential (see "Secrets
//!   in paths" below), in one URL or a comma-separated list of them;
//! - [`redact_in_text`] does the same to every URL found inside a longer text (a driver's error
//!   message that quotes the URL it failed to reach);
//! - [`is_secret_key`] says whether a configuration key names a credential (Kafka's
//!   `sasl.password`, `ssl.key.pem`, `sasl.oauthbearer.config`, …);
//! - [`Secret`] is a configuration value that prints as `***` through `Debug` and `Serialize`;
//! - [`escape_control`] makes text from a row safe to print on a terminal (an `event_type`
//!   holding an escape sequence could otherwise rewrite what an operator sees).
//!
//! ## Secrets in paths
//!
//! Many webhook receivers put their credential in the URL path, where no key names it
//! (`https://hooks.slack.com/services/T000/B000/XXXX`). In `http://`, `https://`, `ws://` and
//! `wss://` URLs (not in database or broker URLs, whose path is a database, a vhost or a number)
//! three rules mask a path segment as `***`:
//!
//! 1. **Known shapes**, by host (any case, any port): Slack (`hooks.slack.com`: every segment
//!    after the third), Discord (`discord.com`, `discordapp.com` and their subdomains: the token
//!    after `webhooks/<id>`), Microsoft Teams (`*.webhook.office.com`, `outlook.office.com`:
//!    every segment after `IncomingWebhook`), Telegram (`api.telegram.org`: the token in
//!    `bot<token>`), Zapier (`hooks.zapier.com`: every segment after `catch/<id>`).
//! 2. **After a name**: the segment that follows a segment naming a credential (`/token/…`,
//!    `/key/…`, `/api-key/…`, `/secret/…`, `/signature/…`: a word of [`is_secret_key`] other
//!    than the `auth` family, so `/auth/callback` stays), and the value of a `name=value`
//!    matrix parameter inside a segment (`;token=…`) whose name [`is_secret_key`] accepts.
//! 3. **Random-looking**: a segment holding a run of at least 20 letters and digits (`-` and
//!    `_` inside the run allowed) that has both letters and digits and either switches between
//!    letters and digits at least once every five characters or has less than a quarter
//!    vowels among its letters — what a generated token (base62, base64url, hex) looks like.
//!    Words, slugs (`my-project-2024-11-25`), version and date segments, camel-case names
//!    (`OrderCreatedHandlerV2`) and numeric ids are kept; a UUID (`8-4-4-4-12` hex) is an
//!    identifier and is kept too, while a long hex digest is masked. The same rule masks such
//!    a value of any query parameter. It is a heuristic: a token that happens to look like
//!    words (about one in ten random 24-character base62 tokens) is not caught by it, which is
//!    why the known shapes come first.
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

/// Words that make a key (a query parameter, a client property) a credential. A key is split
/// into words at every character that is not a letter or digit and where lower case turns to
/// upper case (`accessToken` → `access`, `token`), and also compared as a whole with its
/// separators and case removed (`ACCESS-TOKEN`, `access%5Ftoken` and `accesstoken` are one key),
/// which is a credential when it *ends* with one of these words (`apikey`, `clientsecret`):
/// `sasl.password`, `ssl_key_password`, `X-Api-Key`, `ssl.keystore.key`… but not `keepalive`
/// or `keys_per_batch`.
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
    "session",
    "sessionid",
    "cookie",
    "bearer",
    "hmac",
];

/// Keys that are credentials although none of their words says so.
const SECRET_KEYS: &[&str] = &["sasl.oauthbearer.config", "sasl.kerberos.keytab"];

/// Whether a configuration key or URL query parameter names a credential, so its value must not
/// be printed.
///
/// The key is compared without case and separators, percent-encoding decoded first (see
/// [`SECRET_WORDS`]).
///
/// ```
/// use outbox_types::redact::is_secret_key;
/// assert!(is_secret_key("sasl.password"));
/// assert!(is_secret_key("ssl.key.pem"));
/// assert!(is_secret_key("ssl.certificate.pem")); // PEM text inline: mask it all
/// assert!(is_secret_key("sasl.oauthbearer.config"));
/// assert!(is_secret_key("sslpassword"));
/// assert!(is_secret_key("accessToken"));
/// assert!(is_secret_key("clientSecret"));
/// assert!(is_secret_key("X-API-KEY"));
/// assert!(is_secret_key("access%5Ftoken"));
/// assert!(!is_secret_key("sslmode"));
/// assert!(!is_secret_key("keepalive"));
/// assert!(!is_secret_key("keys_per_batch"));
/// ```
pub fn is_secret_key(key: &str) -> bool {
    let decoded = percent_decode(key);
    let lower = decoded.to_ascii_lowercase();
    if SECRET_KEYS.contains(&lower.as_str()) {
        return true;
    }
    let squashed = squash(&decoded);
    if SECRET_KEYS.iter().any(|k| squash(k) == squashed) {
        return true;
    }
    words(&decoded).any(|word| SECRET_WORDS.contains(&word.as_str()))
        || SECRET_WORDS.iter().any(|word| squashed.ends_with(word))
}

/// `text` in lower case with everything but ASCII letters and digits removed: `X-Api_Key` →
/// `xapikey`.
fn squash(text: &str) -> String {
    text.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// The words of a key, in lower case: split at every character that is not an ASCII letter or
/// digit, and where a lower-case letter or digit is followed by an upper-case one
/// (`clientSecret` → `client`, `secret`; `x-api-key` → `x`, `api`, `key`).
fn words(key: &str) -> impl Iterator<Item = String> + '_ {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut previous: Option<char> = None;
    for c in key.chars() {
        if !c.is_ascii_alphanumeric() {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            previous = None;
            continue;
        }
        if c.is_ascii_uppercase()
            && previous.is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit())
            && !word.is_empty()
        {
            out.push(std::mem::take(&mut word));
        }
        word.push(c.to_ascii_lowercase());
        previous = Some(c);
    }
    if !word.is_empty() {
        out.push(word);
    }
    out.into_iter()
}

/// `text` with its `%XX` escapes decoded where they are ASCII (enough to read a key such as
/// `access%5Ftoken`); anything else is kept as written.
fn percent_decode(text: &str) -> Cow<'_, str> {
    if !text.contains('%') {
        return Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(byte) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .filter(u8::is_ascii)
        {
            out.push(char::from(byte));
            i += 3;
            continue;
        }
        let c = text[i..].chars().next().unwrap_or('\u{fffd}');
        out.push(c);
        i += c.len_utf8();
    }
    Cow::Owned(out)
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

/// The parts of `url` (or of each URL of a comma-separated list) that [`redact_url`] masks, as
/// written and percent-decoded, each at least four characters long; parts holding a template
/// placeholder (`${…}`) are left out. A sink scrubs them from text a peer sends back (an error
/// page that quotes the request's path, which no redactor can recognise without the URL) with
/// [`scrub`].
///
/// ```
/// use outbox_types::redact::url_secrets;
/// let secrets = url_secrets("https://u:pw-1234@h/hooks/token/abcd1234?clientSecret=s%3D3cr3t&id=7");
/// assert!(secrets.contains(&"pw-1234".to_owned()));
/// assert!(secrets.contains(&"abcd1234".to_owned()));
/// assert!(secrets.contains(&"s%3D3cr3t".to_owned()) && secrets.contains(&"s=3cr3t".to_owned()));
/// assert!(!secrets.iter().any(|s| s == "7"));
/// ```
pub fn url_secrets(url: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    for one in url.split(',') {
        let mut out = Out::default();
        redact_into(one, &mut out);
        for hidden in out.hidden {
            if hidden.len() < 4 || hidden.contains("${") {
                continue;
            }
            let decoded = percent_decode(&hidden).into_owned();
            if decoded != hidden {
                secrets.push(decoded);
            }
            secrets.push(hidden);
        }
    }
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    secrets
}

/// `text` with every occurrence of each of `secrets` (from [`url_secrets`]) replaced by
/// [`MASK`], after [`redact_in_text`].
///
/// ```
/// use outbox_types::redact::{scrub, url_secrets};
/// let secrets = url_secrets("https://h/hooks/token/abcd1234");
/// assert_eq!(scrub("Cannot POST /hooks/token/abcd1234", &secrets), "Cannot POST /hooks/token/***");
/// ```
pub fn scrub(text: &str, secrets: &[String]) -> String {
    let mut text = redact_in_text(text);
    for secret in secrets {
        if text.contains(secret.as_str()) {
            text = text.replace(secret.as_str(), MASK);
        }
    }
    text
}

/// What [`redact_url`] writes: the text, and the parts it masked (for [`url_secrets`]).
#[derive(Default)]
struct Out {
    text: String,
    hidden: Vec<String>,
}

impl Out {
    fn push_str(&mut self, s: &str) {
        self.text.push_str(s);
    }

    fn push(&mut self, c: char) {
        self.text.push(c);
    }

    /// Write [`MASK`] in place of `original`.
    fn mask(&mut self, original: &str) {
        self.text.push_str(MASK);
        self.hidden.push(original.to_owned());
    }
}

fn redact_one(url: &str) -> Cow<'_, str> {
    let mut out = Out::default();
    if redact_into(url, &mut out) {
        Cow::Owned(out.text)
    } else {
        Cow::Borrowed(url)
    }
}

/// Write `url` redacted to `out`; `false` (and nothing written) when it is left as it is.
fn redact_into(url: &str, out: &mut Out) -> bool {
    let (authority_start, has_scheme) = match url.find("://") {
        Some(i) => (i + 3, true),
        None => (0, false),
    };
    let scheme = url[..authority_start.saturating_sub(3)].to_ascii_lowercase();
    let rest = &url[authority_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    out.push_str(&url[..authority_start]);
    let host = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..colon]);
                    out.push(':');
                    out.mask(&userinfo[colon + 1..]);
                }
                // A lone user part is a user name for databases and AMQP, a token for HTTP
                // and NATS (`https://TOKEN@host`, `nats://TOKEN@host`).
                None => {
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
                        out.mask(userinfo);
                    }
                }
            }
            out.push_str(&authority[at..]);
            &authority[at + 1..]
        }
        None => {
            out.push_str(authority);
            authority
        }
    };
    let tail = &rest[authority_end..];
    if !has_scheme && !authority.contains('@') && !tail.contains('?') {
        return false;
    }
    // Only web URLs carry credentials in their path (see "Secrets in paths" in the module docs).
    let web = matches!(scheme.as_str(), "http" | "https" | "ws" | "wss");
    let path_end = tail.find(['?', '#']).unwrap_or(tail.len());
    let path = &tail[..path_end];
    if web {
        redact_path(&host_name(host), path, out);
    } else {
        out.push_str(path);
    }
    let tail = &tail[path_end..];
    let (query, fragment) = match tail.find('#') {
        Some(h) => (&tail[..h], &tail[h..]),
        None => (tail, ""),
    };
    if let Some(query) = query.strip_prefix('?') {
        out.push('?');
        redact_pairs(query, web, out);
    }
    if let Some(fragment) = fragment.strip_prefix('#') {
        // `#access_token=…&token_type=bearer`: an OAuth reply's fragment is a query too.
        out.push('#');
        if fragment.contains('=') {
            redact_pairs(fragment, web, out);
        } else {
            out.push_str(fragment);
        }
    }
    true
}

/// The host of an authority (`host:port`, `[v6]:port`), in lower case, without a trailing dot.
fn host_name(authority: &str) -> String {
    let host = if authority.starts_with('[') {
        authority.split_inclusive(']').next().unwrap_or(authority)
    } else {
        authority.split(':').next().unwrap_or(authority)
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether `host` is `domain` or one of its subdomains.
fn under(host: &str, domain: &str) -> bool {
    host == domain
        || host
            .strip_suffix(domain)
            .is_some_and(|rest| rest.ends_with('.'))
}

/// Append `query` (`a=1&b=2`, `;` also separating) with the value of every credential-named
/// pair masked, and with `random` (web URLs) the value of every pair that looks like a
/// generated token.
fn redact_pairs(query: &str, random: bool, out: &mut Out) {
    let mut rest = query;
    loop {
        let end = rest.find(['&', ';']).unwrap_or(rest.len());
        let pair = &rest[..end];
        match pair.split_once('=') {
            Some((name, value))
                if is_secret_key(name) || (random && looks_random(&percent_decode(value))) =>
            {
                out.push_str(name);
                out.push('=');
                out.mask(value);
            }
            _ => out.push_str(pair),
        }
        match rest[end..].chars().next() {
            Some(separator) => {
                out.push(separator);
                rest = &rest[end + 1..];
            }
            None => break,
        }
    }
}

/// Segment names after which the next segment is a credential (rule 2 of "Secrets in paths"):
/// the words of [`is_secret_key`] without the `auth` family, which names login routes
/// (`/auth/callback`, `/oauth/authorize`) far more often than a credential.
fn names_a_path_secret(segment: &str) -> bool {
    let squashed = squash(&percent_decode(segment));
    !squashed.is_empty()
        && !matches!(
            squashed.as_str(),
            "auth" | "oauth" | "oauth2" | "authorization" | "authorize" | "session" | "sessions"
        )
        && is_secret_key(segment)
}

/// Append `path` with the segments that carry a credential masked (see "Secrets in paths").
fn redact_path(host: &str, path: &str, out: &mut Out) {
    // `%2F` is a slash to many servers: a secret behind one is still a segment of its own.
    let segments: Vec<&str> = split_segments(path);
    // Index among the non-empty segments, so `//services//T/B/X` reads like `/services/T/B/X`.
    let mut named: Vec<&str> = Vec::with_capacity(segments.len());
    let mut masked_from: Option<usize> = None;
    let mut previous_names_secret = false;
    for (i, segment) in segments.iter().enumerate() {
        if i > 0 {
            out.push_str(separator_before(path, &segments, i));
        }
        if segment.is_empty() {
            continue;
        }
        let n = named.len();
        named.push(segment);
        let lower = segment.to_ascii_lowercase();
        let known = masked_from.is_some_and(|from| n >= from)
            || known_secret_segment(host, &named, &lower, &mut masked_from);
        if known || previous_names_secret || looks_random(&percent_decode(segment)) {
            out.mask(segment);
            previous_names_secret = false;
            continue;
        }
        previous_names_secret = names_a_path_secret(segment);
        // `;name=value` matrix parameters.
        match segment.split_once(';') {
            Some((head, params)) if params.contains('=') => {
                out.push_str(head);
                out.push(';');
                redact_pairs(params, true, out);
            }
            _ => out.push_str(segment),
        }
    }
}

/// `path` split at `/` and at `%2F` (any case).
fn split_segments(path: &str) -> Vec<&str> {
    let mut segments = Vec::new();
    let mut start = 0;
    let bytes = path.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'/' {
            segments.push(&path[start..i]);
            i += 1;
            start = i;
        } else if bytes[i] == b'%'
            && path[i..]
                .get(..3)
                .is_some_and(|e| e.eq_ignore_ascii_case("%2f"))
        {
            segments.push(&path[start..i]);
            i += 3;
            start = i;
        } else {
            i += 1;
        }
    }
    segments.push(&path[start..]);
    segments
}

/// The separator (`/` or `%2F` as written) between segment `i - 1` and segment `i` of `path`.
fn separator_before<'p>(path: &'p str, segments: &[&str], i: usize) -> &'p str {
    let previous = segments[i - 1];
    // Segments are slices of `path`: the separator starts where the previous one ends.
    let offset = previous.as_ptr() as usize - path.as_ptr() as usize + previous.len();
    if path.as_bytes().get(offset) == Some(&b'/') {
        &path[offset..offset + 1]
    } else {
        &path[offset..(offset + 3).min(path.len())]
    }
}

/// Rule 1 of "Secrets in paths": whether the segment `lower` (the last of `named`, the
/// non-empty segments so far) is a credential of a known receiver on `host`; may set
/// `masked_from`, the index from which every later segment is one.
fn known_secret_segment(
    host: &str,
    named: &[&str],
    lower: &str,
    masked_from: &mut Option<usize>,
) -> bool {
    let n = named.len() - 1;
    let previous = |back: usize| {
        n.checked_sub(back)
            .map(|i| named[i].to_ascii_lowercase())
            .unwrap_or_default()
    };
    if host == "hooks.slack.com" {
        // /services/T…/B…/SECRET, /workflows/T…/A…/ID/SECRET, /triggers/T…/ID/SECRET
        return n >= 3;
    }
    if under(host, "discord.com") || under(host, "discordapp.com") {
        // /api[/v10]/webhooks/ID/TOKEN[/…]
        if previous(2) == "webhooks" {
            *masked_from = Some(n);
            return true;
        }
        return false;
    }
    if under(host, "webhook.office.com") || host == "outlook.office.com" {
        // /webhookb2/GUID@GUID/IncomingWebhook/HEX/GUID
        if previous(1) == "incomingwebhook" {
            *masked_from = Some(n);
            return true;
        }
        return false;
    }
    if host == "api.telegram.org" {
        // /bot123456:ABC…/sendMessage
        return lower.starts_with("bot") && lower.contains(':');
    }
    if host == "hooks.zapier.com" {
        // /hooks/catch/ID/SECRET/
        if previous(2) == "catch" {
            *masked_from = Some(n);
            return true;
        }
        return false;
    }
    false
}

/// Rule 3 of "Secrets in paths": whether `text` holds a run of at least 20 letters and digits
/// (with `-` and `_` inside it), not a UUID, with both letters and digits, that switches
/// between letters and digits at least once every five characters or whose letters are less
/// than a quarter vowels. Generated tokens (base62, base64url, hex) do one or the other (hex
/// and base62 switch often; base62's letters are 19% vowels), words and names do neither
/// (`OrderCreatedEventHandlerV2`: one switch, 36% vowels).
fn looks_random(text: &str) -> bool {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .any(|run| {
            if is_uuid(run) {
                return false;
            }
            let alnum: Vec<char> = run.chars().filter(char::is_ascii_alphanumeric).collect();
            let letters = alnum.iter().filter(|c| c.is_ascii_alphabetic()).count();
            if alnum.len() < 20 || letters == 0 || letters == alnum.len() {
                return false;
            }
            let switches = alnum
                .windows(2)
                .filter(|w| w[0].is_ascii_digit() != w[1].is_ascii_digit())
                .count();
            let vowels = alnum
                .iter()
                .filter(|c| matches!(c.to_ascii_lowercase(), 'a' | 'e' | 'i' | 'o' | 'u'))
                .count();
            switches * 5 >= alnum.len() || vowels * 4 < letters
        })
}

/// `8-4-4-4-12` hexadecimal digits.
fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.chars().all(|c| c.is_ascii_hexdigit()))
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

    /// Credential-named query keys in any spelling: camel case, upper case, other separators,
    /// percent-encoded, in a fragment, after `;`.
    #[test]
    fn credential_keys_are_found_in_every_spelling() {
        let cases = [
            (
                "https://h/x?accessToken=s1&q=1",
                "https://h/x?accessToken=***&q=1",
            ),
            (
                "https://h/x?clientSecret=s1",
                "https://h/x?clientSecret=***",
            ),
            ("https://h/x?apiToken=s1", "https://h/x?apiToken=***"),
            ("https://h/x?api_key=s1", "https://h/x?api_key=***"),
            ("https://h/x?x-api-key=s1", "https://h/x?x-api-key=***"),
            ("https://h/x?X-API-KEY=s1", "https://h/x?X-API-KEY=***"),
            ("https://h/x?ApiKey=s1", "https://h/x?ApiKey=***"),
            ("https://h/x?apikey=s1", "https://h/x?apikey=***"),
            ("https://h/x?sig=s1&sv=2024", "https://h/x?sig=***&sv=2024"),
            ("https://h/x?signature=s1", "https://h/x?signature=***"),
            (
                "https://h/x?ACCESS-TOKEN=s1",
                "https://h/x?ACCESS-TOKEN=***",
            ),
            (
                "https://h/x?access%5Ftoken=s1",
                "https://h/x?access%5Ftoken=***",
            ),
            ("https://h/x?auth[token]=s1", "https://h/x?auth[token]=***"),
            ("https://h/x?a=1;token=s1", "https://h/x?a=1;token=***"),
            (
                "https://h/cb#access_token=s1&token_type=bearer&expires_in=3600",
                "https://h/cb#access_token=***&token_type=***&expires_in=3600",
            ),
            ("https://h/x#section-2", "https://h/x#section-2"),
            (
                "https://h/x?page=2&sort=created_at&region=eu",
                "https://h/x?page=2&sort=created_at&region=eu",
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(redact_url(input), expected, "{input}");
        }
        for key in [
            "accessToken",
            "clientSecret",
            "apiToken",
            "refresh_token",
            "SessionId",
        ] {
            assert!(is_secret_key(key), "{key}");
        }
        for key in [
            "keys_per_batch",
            "client.id",
            "page",
            "region",
            "type",
            "monitor",
        ] {
            assert!(!is_secret_key(key), "{key}");
        }
    }

    /// Secrets in web URLs' paths: the known receivers' shapes, the segment after a
    /// credential's name, and long random-looking segments; ordinary paths are kept.
    #[test]
    fn secrets_in_paths_are_masked_and_ordinary_paths_kept() {
        let slack_secret = "aB3dE5gH7jK9mN1pQ3rS5tU7";
        let cases = [
            (
                format!("https://hooks.slack.com/services/T0123ABCD/B0456EFGH/{slack_secret}"),
                "https://hooks.slack.com/services/T0123ABCD/B0456EFGH/***".to_owned(),
            ),
            (
                "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX".into(),
                "https://hooks.slack.com/services/T000/B000/***".into(),
            ),
            (
                "https://discord.com/api/webhooks/123456789012345678/tOkEnPaRt_With-Letters".into(),
                "https://discord.com/api/webhooks/123456789012345678/***".into(),
            ),
            (
                "https://acme.webhook.office.com/webhookb2/a@b/IncomingWebhook/abcdef/0-1-2".into(),
                "https://acme.webhook.office.com/webhookb2/a@b/IncomingWebhook/***/***".into(),
            ),
            (
                "https://api.telegram.org/bot123456:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw/sendMessage"
                    .into(),
                "https://api.telegram.org/***/sendMessage".into(),
            ),
            (
                "https://hooks.zapier.com/hooks/catch/123456/abcdef/".into(),
                "https://hooks.zapier.com/hooks/catch/123456/***/".into(),
            ),
            (
                "https://maker.ifttt.com/trigger/order/with/key/dXyZabc".into(),
                "https://maker.ifttt.com/trigger/order/with/key/***".into(),
            ),
            (
                "https://h/api/token/plainword/orders".into(),
                "https://h/api/token/***/orders".into(),
            ),
            (
                "https://h/hooks/9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
                    .into(),
                "https://h/hooks/***".into(),
            ),
            (
                "https://h/x;jsessionid=abc;lang=en/y".into(),
                "https://h/x;jsessionid=***;lang=en/y".into(),
            ),
            (
                "https://h/cb?code=Zx81Kq2Lm9Np4Rs7Tv3Wy6Ab".into(),
                "https://h/cb?code=***".into(),
            ),
        ];
        for (input, expected) in &cases {
            assert_eq!(&redact_url(input), expected, "{input}");
        }
        // Ordinary paths, ids and templates are kept.
        for kept in [
            "https://hooks.example.com/orders/${event_type}",
            "https://h/v1/projects/my-project-123/topics/orders",
            "https://h/api/2024-11-25/events/order-created-2024",
            "https://h/handlers/OrderCreatedEventHandlerV2",
            "https://h/orders/550e8400-e29b-41d4-a716-446655440000",
            "https://h/orders/12345678901234567890123",
            "https://h/auth/callback",
            "https://h/oauth/authorize?client_id=app&state=xyz",
            "https://h/events/..%2F..%2Fadmin%3Fdebug%3D1%23",
            "https://hooks.slack.com/services",
            "postgres://u@h/db_20241125_prod_eu_west_1abc",
            "sqlite:///tmp/outbox-test-3f9a8b7c6d5e4f3a2b1c/o.db",
        ] {
            assert_eq!(redact_url(kept), kept);
        }
    }

    /// Spellings meant to slip a path secret past the redactor: another case, a port, a
    /// trailing dot in the host, doubled slashes, `%2F` for `/`, a credential in userinfo and
    /// query at once, inside an error message.
    #[test]
    fn hostile_spellings_of_path_secrets_are_masked() {
        let secret = "XyZ9sEcReT8tOkEn7vAlUe6Q";
        for url in [
            format!("https://HOOKS.SLACK.COM/services/T1/B2/{secret}"),
            format!("https://hooks.slack.com:443/services/T1/B2/{secret}"),
            format!("https://hooks.slack.com./services/T1/B2/{secret}"),
            format!("https://hooks.slack.com//services//T1//B2//{secret}"),
            format!("https://hooks.slack.com/services%2FT1%2FB2%2F{secret}"),
            format!("https://hooks.slack.com/services/T1/B2/{secret}?x=1#frag"),
            format!("https://u:{secret}@h/x?clientSecret={secret}"),
            format!("https://h/x?Client-Secret={secret}"),
            format!("HTTPS://h/key/{secret}"),
            format!("https://ptb.discord.com/api/v10/webhooks/1/{secret}"),
            format!("wss://h/socket/{secret}"),
        ] {
            let shown = redact_url(&url);
            assert!(!shown.contains(secret), "{url} → {shown}");
            let text = format!("error sending request for url ({url}): connection refused");
            let shown = redact_in_text(&text);
            assert!(!shown.contains(secret), "{text} → {shown}");
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
