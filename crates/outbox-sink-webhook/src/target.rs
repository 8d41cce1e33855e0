//! Where a request may go: the one place that turns an event into a URL and decides whether the
//! sink's credentials may travel there.
//!
//! The sink attaches `Authorization` and the signature to every request, so the URL of a request
//! must never be chosen by whoever can insert an outbox row. The `url` template fixes the origin
//! (scheme, host, port); the event's `destination` column may pick a path under that origin, or
//! a host the operator listed in `allowed_hosts`, and nothing else. Template values are
//! percent-encoded, and a path with a dot segment (`.`, `..`, `%2e%2e`) is refused, because URL
//! parsers resolve those and a value could otherwise climb out of the path the operator wrote.
//!
//! Every check runs before anything is sent: an event whose URL is refused is rejected without
//! a connection to its host.

use outbox_types::Event;
use outbox_types::redact::{escape_control, redact_url};
use outbox_types::routing::Template;
use reqwest::Url;

/// A URL that passed [`Targets::resolve`]: its origin is the configured one or an allowed host,
/// so the sink's credentials may be sent to it. Only this module makes one.
#[derive(Clone, Debug)]
pub(crate) struct Permitted(Url);

impl Permitted {
    #[cfg(test)]
    pub(crate) fn url(&self) -> &Url {
        &self.0
    }

    pub(crate) fn into_url(self) -> Url {
        self.0
    }
}

/// One `allowed_hosts` entry: `hooks.example.com`, `*.example.com` (any subdomain, not the
/// domain itself), either with `:port`, or an IP address (`10.0.0.7:8443`, `[::1]:8080`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostPattern {
    /// Lower case, IDNA-normalised as `Url` writes hosts; for a wildcard, the suffix after `*.`.
    host: String,
    wildcard: bool,
    /// `None`: only the scheme's default port (80 for `http`, 443 for `https`).
    port: Option<u16>,
}

impl HostPattern {
    /// Parse one entry; the error names the entry and the accepted forms.
    pub(crate) fn parse(entry: &str) -> Result<Self, String> {
        let fail = |why: &str| {
            format!(
                "`allowed_hosts` entry `{}` {why}: write a host name (`hooks.example.com`), a subdomain wildcard (`*.example.com`) or either with a port (`hooks.example.com:8443`); IPv6 addresses in brackets (`[::1]:8080`)",
                escape_control(entry)
            )
        };
        let trimmed = entry.trim();
        if trimmed.is_empty() {
            return Err(fail("is empty"));
        }
        if trimmed.contains("://") || trimmed.contains(['/', '@', '?', '#', '\\']) {
            return Err(fail("is not a bare host (no scheme, user, path or query)"));
        }
        let (wildcard, rest) = match trimmed.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, trimmed),
        };
        if rest.contains('*') {
            return Err(fail("has a `*` that is not a leading `*.`"));
        }
        let (host, port) = if let Some(inner) = rest.strip_prefix('[') {
            let close = inner
                .find(']')
                .ok_or_else(|| fail("opens `[` without `]`"))?;
            let after = &inner[close + 1..];
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| fail("has text after `]`"))?,
                ),
            };
            (&rest[..close + 2], port)
        } else {
            match rest.split_once(':') {
                None => (rest, None),
                Some((host, port)) if !port.contains(':') => (host, Some(port)),
                Some(_) => return Err(fail("looks like an IPv6 address without brackets")),
            }
        };
        let port = match port {
            None => None,
            Some(p) => Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| fail("has a port that is not a number from 1 to 65535"))?,
            ),
        };
        // Normalise the host exactly as the URL parser will write it in a request URL.
        let probe = if wildcard {
            format!("http://x.{host}/")
        } else {
            format!("http://{host}/")
        };
        let url = Url::parse(&probe).map_err(|e| fail(&format!("is not a valid host ({e})")))?;
        let normalised = url
            .host_str()
            .ok_or_else(|| fail("is not a valid host"))?
            .to_owned();
        let host = if wildcard {
            match normalised.strip_prefix("x.") {
                Some(suffix) if !suffix.is_empty() && url.domain().is_some() => suffix.to_owned(),
                _ => return Err(fail("is a wildcard over something that is not a domain")),
            }
        } else {
            normalised
        };
        Ok(HostPattern {
            host,
            wildcard,
            port,
        })
    }

    /// Whether `url`'s host and port are this entry's.
    pub(crate) fn matches(&self, url: &Url) -> bool {
        let Some(host) = url.host_str() else {
            return false;
        };
        let host_ok = if self.wildcard {
            host.len() > self.host.len() + 1
                && host.ends_with(&self.host)
                && host.as_bytes()[host.len() - self.host.len() - 1] == b'.'
        } else {
            host == self.host
        };
        let port_ok = match self.port {
            // `Url` drops a port equal to the scheme's default, so `None` means "default".
            None => url.port().is_none(),
            Some(port) => url.port_or_known_default() == Some(port),
        };
        host_ok && port_ok
    }
}

/// The `url` template, the hosts a row may name besides its origin, and whether plain `http://`
/// is allowed: everything needed to decide an event's URL.
#[derive(Clone, Debug)]
pub(crate) struct Targets {
    template: Template,
    /// The template's scheme and authority hold no placeholder: every event gets the same origin.
    fixed_origin: bool,
    allowed: Vec<HostPattern>,
    https_only: bool,
    /// An event destination that is neither a path nor a URL is a topic name (the `debezium`
    /// source routes every event to one, `outbox.event.Order`): post to the template, as
    /// Debezium Server's HTTP sink posts every event to its one URL.
    topic_destinations: bool,
}

/// Byte offsets in `url` of the authority (`user@host:port`): from after `://` up to the first
/// `/`, `\`, `?` or `#` (a `\` ends it too, as WHATWG parsers read `http(s)` URLs). `None`
/// when there is no `://`.
fn authority(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://")? + 3;
    let end = url[start..]
        .find(['/', '\\', '?', '#'])
        .map_or(url.len(), |i| start + i);
    Some((start, end))
}

/// The first dot segment (`.` or `..`, also written `%2e`, `.%2E`, …) in the path of `url` (an
/// absolute URL, or a path starting with `/`). URL parsers resolve these, so they would move the
/// request out of the path it was built in.
fn dot_segment(url: &str) -> Option<String> {
    let path_start = if url.starts_with('/') {
        0
    } else {
        authority(url).map_or(0, |(_, end)| end)
    };
    let rest = &url[path_start..];
    let path = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    path.split(['/', '\\']).find_map(|segment| {
        let decoded = segment
            .to_ascii_lowercase()
            .replace("%2e", ".")
            .replace(['\t', '\n', '\r'], "");
        (decoded == "." || decoded == "..").then(|| segment.to_owned())
    })
}

impl Targets {
    /// Check the template and the allowed hosts; errors are configuration errors naming the key
    /// and the fix.
    pub(crate) fn new(
        template: Template,
        allowed_hosts: &[String],
        https_only: bool,
    ) -> Result<Self, String> {
        let text = template.as_str();
        let shown = redact_url(text);
        let allowed = allowed_hosts
            .iter()
            .map(|entry| HostPattern::parse(entry))
            .collect::<Result<Vec<_>, _>>()?;
        let (start, end) = authority(text).ok_or_else(|| {
            format!("`url = \"{shown}\"` must start with `http://` or `https://`")
        })?;
        let fixed_origin = !text[..end].contains("${");
        if !fixed_origin && allowed.is_empty() {
            return Err(format!(
                "`url = \"{shown}\"` has a placeholder in its scheme or host part; the host of a request must be fixed by configuration, so that an event cannot choose where the credentials go: move the placeholder into the path, or list every host it may produce in `allowed_hosts`"
            ));
        }
        if fixed_origin {
            let origin = Url::parse(&text[..end]).map_err(|e| {
                format!(
                    "`url = \"{shown}\"` does not start with a valid `scheme://host[:port]` ({e})"
                )
            })?;
            if origin.host_str().is_none() || start == end {
                return Err(format!("`url = \"{shown}\"` names no host"));
            }
        }
        if let Some(segment) = dot_segment(text) {
            return Err(format!(
                "`url = \"{shown}\"` has the dot segment `{segment}` in its path: write the path without `.` or `..` segments"
            ));
        }
        Ok(Targets {
            template,
            fixed_origin,
            allowed,
            https_only,
            topic_destinations: false,
        })
    }

    /// Treat event destinations that are neither a path nor a URL as topic names and post
    /// those events to the template (`format = "debezium"`).
    pub(crate) fn with_topic_destinations(mut self, on: bool) -> Self {
        self.topic_destinations = on;
        self
    }

    /// Whether some `allowed_hosts` entry admits `url`.
    fn allowed(&self, url: &Url) -> bool {
        self.allowed.iter().any(|p| p.matches(url))
    }

    fn check_scheme(&self, url: &Url) -> Result<(), String> {
        match url.scheme() {
            "https" => Ok(()),
            "http" if !self.https_only => Ok(()),
            other => Err(format!(
                "`{}` uses `{other}://`, but only {} is allowed",
                redact_url(url.as_str()),
                if self.https_only {
                    "`https://` (tls = true)"
                } else {
                    "`http://` or `https://`"
                }
            )),
        }
    }

    /// The URL for `event`, or why it is refused (a permanent rejection: nothing was sent).
    ///
    /// - no `destination`: the template rendered with percent-encoded values;
    /// - a `destination` starting with `/`: that path (and query) under the template's origin;
    /// - an absolute `http(s)` `destination`: allowed when its origin is the template's (the
    ///   template's user info, if any, is kept) or its host is in `allowed_hosts`.
    pub(crate) fn resolve(&self, event: &Event) -> Result<Permitted, String> {
        let rendered = self.template.render_url_encoded(event);
        if let Some(segment) = dot_segment(&rendered) {
            return Err(format!(
                "the URL built from `url = \"{}\"` has the dot segment `{}` in its path (from a value of this event); refusing to send it, since a URL parser would resolve it to another path. Change the event's value, or the template",
                redact_url(self.template.as_str()),
                escape_control(&segment)
            ));
        }
        let base = Url::parse(&rendered).map_err(|e| {
            format!(
                "`{}` is not a valid URL ({e}); check `url = \"{}\"` and the event's values",
                escape_control(&redact_url(&rendered)),
                redact_url(self.template.as_str())
            )
        })?;
        self.check_scheme(&base)?;
        if !self.fixed_origin && !self.allowed(&base) {
            return Err(self.foreign_host(&base, "the `url` template rendered over this event"));
        }
        let (_, authority_end) = authority(&rendered).unwrap_or((0, rendered.len()));
        let prefix = &rendered[..authority_end];
        let own = event
            .destination
            .as_deref()
            .filter(|d| !d.is_empty())
            .filter(|d| !(self.topic_destinations && !d.starts_with('/') && !d.contains("://")));
        let target = match own {
            None => base.clone(),
            Some(destination) => self.destination(destination, &base, prefix)?,
        };
        self.check_scheme(&target)?;
        // Whatever path led here, the credentials only go to the template's origin or an
        // allowed host.
        if target.origin() != base.origin() && !self.allowed(&target) {
            return Err(self.foreign_host(&target, "the event's destination column"));
        }
        Ok(Permitted(target))
    }

    /// The URL named by an event's own `destination` column.
    fn destination(&self, destination: &str, base: &Url, prefix: &str) -> Result<Url, String> {
        let shown = || escape_control(&redact_url(destination)).into_owned();
        if destination.chars().any(|c| c.is_control() || c == ' ') {
            return Err(format!(
                "the destination column `{}` holds spaces or control characters: it must be a path starting with `/` or an `http(s)://` URL",
                shown()
            ));
        }
        if let Some(segment) = dot_segment(destination) {
            return Err(format!(
                "the destination column `{}` has the dot segment `{}` in its path; write the path without `.` or `..` segments",
                shown(),
                escape_control(&segment)
            ));
        }
        if destination.starts_with('/') {
            // Appended to `scheme://authority` as text (never `Url::join`, which reads `//host`
            // as a new host); the origin is checked again below.
            let joined = format!("{prefix}{destination}");
            let url = Url::parse(&joined).map_err(|e| {
                format!(
                    "the destination column `{}` does not make a valid URL under `{}` ({e})",
                    shown(),
                    redact_url(prefix)
                )
            })?;
            if url.origin() != base.origin() {
                return Err(self.foreign_host(&url, "the event's destination column"));
            }
            return Ok(url);
        }
        let url = match Url::parse(destination) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => url,
            _ => {
                return Err(format!(
                    "the destination column `{}` is neither a path starting with `/` (sent under `{}`) nor an `http(s)://` URL; clear it to use the `url` template",
                    shown(),
                    redact_url(prefix)
                ));
            }
        };
        let same_origin = url.origin() == base.origin();
        if !same_origin && !self.allowed(&url) {
            return Err(self.foreign_host(&url, "the event's destination column"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!(
                "the destination column `{}` carries user info (`user:password@`): credentials come from the sink's configuration only; remove them from the row",
                shown()
            ));
        }
        if same_origin {
            // The configured origin: keep the template's own user info and authority, take
            // the row's path and query.
            let tail = authority(destination).map_or("", |(_, end)| &destination[end..]);
            return Url::parse(&format!("{prefix}{tail}")).map_err(|e| {
                format!(
                    "the destination column `{}` is not a valid URL ({e})",
                    shown()
                )
            });
        }
        Ok(url)
    }

    /// Why a URL on a host nobody configured is refused, naming the host and the opt-in.
    fn foreign_host(&self, url: &Url, source: &str) -> String {
        let host = match (url.host_str(), url.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_owned(),
            (None, _) => "(no host)".to_owned(),
        };
        let host = escape_control(&host).into_owned();
        let origin = if self.fixed_origin {
            authority(self.template.as_str())
                .map(|(_, end)| redact_url(&self.template.as_str()[..end]))
                .unwrap_or_default()
        } else {
            "(templated; see `allowed_hosts`)".to_owned()
        };
        format!(
            "{source} names host `{host}`, which is not the configured origin `{origin}` nor in `allowed_hosts`: nothing was sent (the sink's credentials only go to configured hosts). Send to a path (`/…`) under the configured origin, or, if `{host}` is yours, add it to `allowed_hosts`"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns_match_exact_hosts_subdomains_and_ports() {
        // A pattern, the URLs it matches, and the URLs it does not.
        let cases: &[(&str, &[&str], &[&str])] = &[
            (
                "Hooks.Example.com",
                &[
                    "https://hooks.example.com/x",
                    "http://hooks.example.com:80/x",
                ],
                &[
                    "https://hooks.example.com:8443/x",
                    "https://a.hooks.example.com/x",
                    "https://hooks.example.com.evil.net/x",
                ],
            ),
            (
                "*.example.com",
                &["https://a.example.com/", "https://a.b.example.com/"],
                &[
                    "https://example.com/",
                    "https://badexample.com/",
                    "https://a.example.com:444/",
                ],
            ),
            // 2130706433 is 127.0.0.1 written as one number: the same address.
            (
                "127.0.0.1:8080",
                &["http://127.0.0.1:8080/", "http://2130706433:8080/"],
                &["http://127.0.0.1/", "http://127.0.0.1:8081/"],
            ),
            // A port equal to the default of one scheme only matches that scheme.
            (
                "h.example:443",
                &["https://h.example/"],
                &["http://h.example/"],
            ),
            ("[::1]:9000", &["http://[::1]:9000/"], &[]),
        ];
        for (pattern, matching, others) in cases {
            let p = HostPattern::parse(pattern).unwrap();
            for url in *matching {
                assert!(p.matches(&Url::parse(url).unwrap()), "{pattern} ~ {url}");
            }
            for url in *others {
                assert!(!p.matches(&Url::parse(url).unwrap()), "{pattern} !~ {url}");
            }
        }

        for bad in [
            "",
            "https://h",
            "h/path",
            "u@h",
            "h:0",
            "h:99999",
            "a.*.com",
            "::1",
            "*.1.2.3.4",
        ] {
            let err = HostPattern::parse(bad).unwrap_err();
            assert!(err.contains("allowed_hosts"), "{bad}: {err}");
        }
    }

    fn event(aggregate_id: &str, destination: Option<&str>) -> Event {
        let event = outbox_types::NewEvent::from_json("order", aggregate_id, "OrderCreated", "{}")
            .unwrap()
            .with_header("tenant", "acme");
        match destination {
            Some(d) => event.with_destination(d),
            None => event,
        }
        .claimed(1)
    }

    fn targets(url: &str, allowed: &[&str]) -> Targets {
        let allowed: Vec<String> = allowed.iter().map(|s| s.to_string()).collect();
        Targets::new(Template::parse(url).unwrap(), &allowed, false).unwrap()
    }

    fn resolved(t: &Targets, destination: Option<&str>) -> Result<String, String> {
        t.resolve(&event("42", destination))
            .map(|p| p.url().to_string())
    }

    #[test]
    fn a_destination_can_only_pick_a_path_under_the_configured_origin_or_an_allowed_host() {
        let t = targets(
            "https://u:p@hooks.example.com/o/${aggregate_id}?k=1",
            &["partner.example"],
        );
        for (destination, url) in [
            (None, "https://u:p@hooks.example.com/o/42?k=1"),
            (Some(""), "https://u:p@hooks.example.com/o/42?k=1"),
            // A path replaces path and query, under the template's origin and user info.
            (
                Some("/audit?x=1"),
                "https://u:p@hooks.example.com/audit?x=1",
            ),
            // `//host` and `/\host` are paths here, never a new host.
            (
                Some("//evil.example/x"),
                "https://u:p@hooks.example.com//evil.example/x",
            ),
            (
                Some("/\\evil.example/x"),
                "https://u:p@hooks.example.com//evil.example/x",
            ),
            // The configured origin spelled out: the template's user info is kept.
            (
                Some("https://HOOKS.example.com:443/z"),
                "https://u:p@hooks.example.com/z",
            ),
            (
                Some("http://partner.example/in"),
                "http://partner.example/in",
            ),
        ] {
            assert_eq!(resolved(&t, destination).unwrap(), url, "{destination:?}");
        }
        for foreign in [
            "https://evil.example/x",
            "http://hooks.example.com/x", // another scheme is another origin
            "https://hooks.example.com:8443/x",
            "https://partner.example:8443/x",
            "https://hooks.example.com.evil.example/x",
            "https://hooks.example.com@evil.example/x",
        ] {
            let err = resolved(&t, Some(foreign)).unwrap_err();
            assert!(
                err.contains("not the configured origin `https://u:***@hooks.example.com`")
                    && err.contains("allowed_hosts"),
                "{foreign}: {err}"
            );
        }
        for (bad, why) in [
            ("audit.events", "neither a path"),
            ("file:///etc/passwd", "neither a path"),
            ("/a/../b", "dot segment"),
            ("/a b", "spaces or control characters"),
            ("/a\tb/..", "spaces or control characters"),
            ("https://x:y@hooks.example.com/z", "user info"),
        ] {
            let err = resolved(&t, Some(bad)).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_templated_host_must_render_to_an_allowed_host() {
        let t = targets(
            "https://${header.tenant}.example.com/in",
            &["*.example.com"],
        );
        assert_eq!(resolved(&t, None).unwrap(), "https://acme.example.com/in");
        assert_eq!(
            resolved(&t, Some("/other")).unwrap(),
            "https://acme.example.com/other"
        );
        let t = targets(
            "https://${header.tenant}.example.com/in",
            &["other.example.com"],
        );
        let err = resolved(&t, None).unwrap_err();
        assert!(
            err.contains("`acme.example.com`") && err.contains("allowed_hosts"),
            "{err}"
        );
        assert!(
            Targets::new(
                Template::parse("https://${header.tenant}.example.com/").unwrap(),
                &[],
                false
            )
            .unwrap_err()
            .contains("allowed_hosts")
        );
    }

    #[test]
    fn tls_only_refuses_plain_http_destinations() {
        let allowed = vec!["partner.example".to_owned()];
        let t = Targets::new(
            Template::parse("https://h.example/x").unwrap(),
            &allowed,
            true,
        )
        .unwrap();
        let err = resolved(&t, Some("http://partner.example/x")).unwrap_err();
        assert!(err.contains("tls = true"), "{err}");
    }

    #[test]
    fn dot_segments_are_found_in_every_spelling() {
        for url in [
            "http://h/a/../b",
            "http://h/a/./b",
            "http://h/..",
            "http://h/a/%2e%2E/b",
            "http://h/a/.%2e/b",
            "http://h/a\\..\\b",
            "/a/../b",
            "/..",
        ] {
            assert!(dot_segment(url).is_some(), "{url}");
        }
        for url in [
            "http://h/a/..%2F..%2Fadmin/b",
            "http://h/a/...",
            "http://h/a/.b/",
            "http://h/a?x=/../",
            "http://h/a#/../",
            "/a/b?c=..",
            "http://../a",
        ] {
            assert!(dot_segment(url).is_none(), "{url}");
        }
    }
}
