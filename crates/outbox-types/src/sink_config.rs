//! The configuration vocabulary every sink shares, parsed in one place.
//!
//! Every broker sink's settings have the same keys for the same things: a destination template
//! defaulting to `events.${event_type}`, `format` with the `cloudevents_*` keys, `user` (with
//! `username` as an old spelling in some sinks), secrets as `password` / `password_env` (and
//! `*_env` for every other secret), `tls`, timeouts as humantime strings. The keys stay fields
//! of each sink's own config struct (each struct refuses unknown keys, which serde cannot do
//! through a flattened struct); what is shared is how they are read, so a setting means the
//! same thing, and a mistake reads the same, in every sink. `docs/contributing-a-sink.md` shows
//! how a new sink uses these pieces.
//!
//! ```
//! use outbox_types::routing::{BodyFormat, CloudEventsKeys};
//! use outbox_types::sink_config;
//!
//! let routing = sink_config::routing(
//!     sink_config::default_destination(),
//!     BodyFormat::Raw,
//!     CloudEventsKeys::default(),
//! )
//! .unwrap();
//! assert_eq!(routing.destination.as_str(), "events.${event_type}");
//! assert_eq!(sink_config::password(None, None).unwrap(), None);
//! ```

use crate::SinkError;
use crate::redact::Secret;
use crate::routing::{BodyFormat, CloudEventsKeys, Routing, Template};

/// A configuration error with `message`, which names the setting and the fix.
pub fn config_error(message: impl Into<String>) -> SinkError {
    SinkError::Config(message.into())
}

/// `events.${event_type}`, the destination template of every sink's defaults.
pub fn default_destination() -> Template {
    // The text parses; the fallback only keeps an `unwrap` out of library code.
    Template::parse("events.${event_type}").unwrap_or_else(|_| Template::fixed("events"))
}

/// The routing of a sink: `destination` for events that name none, with the body that `format`
/// and the `cloudevents_*` keys describe. The error names the key to add or remove.
pub fn routing(
    destination: Template,
    format: BodyFormat,
    cloudevents: CloudEventsKeys<'_>,
) -> Result<Routing, SinkError> {
    let format = format.payload_format(cloudevents).map_err(config_error)?;
    Ok(Routing::new(destination).with_format(format))
}

/// A secret a configuration gives either inline (`inline_key`, e.g. `password`) or through an
/// environment variable it names (`env_key`, e.g. `password_env`): the value, `None` when
/// neither is set. The configuration error names the keys and the fix: both set, an empty
/// inline value (an empty password or signing key protects nothing), a variable that is unset
/// or empty.
///
/// ```
/// use outbox_types::redact::Secret;
/// use outbox_types::sink_config::secret;
/// let inline = Secret::new("s3cret");
/// assert_eq!(secret("password", Some(&inline), "password_env", None).unwrap().as_deref(), Some("s3cret"));
/// assert_eq!(secret("password", None, "password_env", None).unwrap(), None);
/// let err = secret("password", Some(&inline), "password_env", Some("PW")).unwrap_err();
/// assert!(err.to_string().contains("keep one"));
/// let err = secret("token", None, "token_env", Some("OUTBOX_DOCTEST_UNSET")).unwrap_err();
/// assert!(err.to_string().contains("export OUTBOX_DOCTEST_UNSET"));
/// ```
pub fn secret(
    inline_key: &str,
    inline: Option<&Secret>,
    env_key: &str,
    env: Option<&str>,
) -> Result<Option<String>, SinkError> {
    let resolved = match (inline, env) {
        (Some(_), Some(_)) => Err(format!(
            "both `{inline_key}` and `{env_key}` are set: keep one (prefer `{env_key}`, so the secret stays out of the file)"
        )),
        (Some(secret), None) if secret.is_empty() => Err(format!(
            "`{inline_key} = \"\"` is empty: set the value (better: `{env_key} = \"VAR\"`), or remove the key"
        )),
        (Some(secret), None) => Ok(Some(secret.expose().to_owned())),
        (None, Some(var)) => match std::env::var(var) {
            Ok(value) if !value.is_empty() => Ok(Some(value)),
            Ok(_) => Err(format!(
                "`{env_key} = \"{var}\"` names an empty environment variable: export {var} with the secret"
            )),
            Err(_) => Err(format!(
                "`{env_key} = \"{var}\"` names an environment variable that is not set: export {var}, or set `{inline_key}`"
            )),
        },
        (None, None) => Ok(None),
    };
    resolved.map_err(config_error)
}

/// The password, from `password` or the variable named by `password_env`.
pub fn password(
    password: Option<&Secret>,
    password_env: Option<&str>,
) -> Result<Option<String>, SinkError> {
    secret("password", password, "password_env", password_env)
}

/// The user from `user`, or from its old spelling `username`; both set is an error. The second
/// value is the deprecation warning to log (naming `sink`) when the old spelling was used: this
/// crate does no logging.
pub fn user<'a>(
    sink: &str,
    user: Option<&'a String>,
    username: Option<&'a String>,
) -> Result<(Option<&'a String>, Option<String>), SinkError> {
    match (user, username) {
        (Some(_), Some(_)) => Err(config_error(
            "both `user` and `username` are set: keep `user` (`username` is its old spelling)",
        )),
        (None, Some(old)) => Ok((
            Some(old),
            Some(format!(
                "{sink} setting `username` is deprecated: write `user = \"…\"` (the same key as every other sink)"
            )),
        )),
        (user, None) => Ok((user, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_takes_the_old_spelling_but_not_both() {
        let (new, old) = ("a".to_owned(), "b".to_owned());
        assert_eq!(user("Redis", Some(&new), None).unwrap(), (Some(&new), None));
        let (taken, warning) = user("Redis", None, Some(&old)).unwrap();
        assert_eq!(taken, Some(&old));
        assert!(
            warning
                .unwrap()
                .starts_with("Redis setting `username` is deprecated")
        );
        assert_eq!(user("Redis", None, None).unwrap(), (None, None));
        let err = user("Redis", Some(&new), Some(&old)).unwrap_err();
        assert!(err.to_string().contains("keep `user`"), "{err}");
    }

    #[test]
    fn routing_names_the_missing_cloudevents_key() {
        let err = routing(
            default_destination(),
            BodyFormat::Cloudevents,
            CloudEventsKeys::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("cloudevents_source"), "{err}");
    }
}
