//! # outbox-sink-common
//!
//! What the broker sinks share and `outbox-types` (which every crate shares, sinks or not) does
//! not hold, so it is written once:
//!
//! - [`config_struct!`] declares a sink's settings struct, so the keys every sink shares are
//!   written once: `format`, the `cloudevents_*` keys and `password`/`password_env`, with the
//!   same types, the same documentation and the same defaults in every sink;
//! - [`unique_headers`], the routing headers with each name once, for the sinks whose headers
//!   are compared without case (NATS, Redis, HTTP);
//! - [`login`], a user with a password or a token, checked the same way in the sinks that take
//!   either (NATS, HTTP), and [`secret!`], a secret setting read from its two keys.
//!
//! Why a macro for the settings: each sink's struct refuses unknown keys
//! (`#[serde(deny_unknown_fields)]`, so a misspelt key is an error), and serde cannot refuse them
//! through a `#[serde(flatten)]`ed shared struct. The shared keys therefore have to stay fields of
//! each sink's own struct; the macro writes them there, at the place the sink names (the order of
//! the fields is the order `outbox config check` prints them in). How the keys are *read* is
//! shared through [`outbox_types::sink_config`].
//!
//! Each field is written with its default after `=`; the macro writes the `Default` impl from
//! them, so a field and its default stand together.
//!
//! ```
//! use serde::{Deserialize, Serialize};
//!
//! outbox_sink_common::config_struct! {
//!     /// Settings of an example sink.
//!     #[derive(Clone, Debug, Deserialize, Serialize)]
//!     #[serde(deny_unknown_fields, default)]
//!     pub struct ExampleSinkConfig {
//!         /// Where to send.
//!         pub url: String = "example://127.0.0.1".to_owned(),
//!         @format,
//!         @cloudevents,
//!         /// Talk TLS.
//!         pub tls: bool = false,
//!     }
//! }
//!
//! let config: ExampleSinkConfig = serde_json::from_str(r#"{"format": "cloudevents"}"#).unwrap();
//! assert_eq!(config.url, "example://127.0.0.1");
//! assert!(config.cloudevents_keys().source.is_none());
//! let err = serde_json::from_str::<ExampleSinkConfig>(r#"{"formt": "raw"}"#).unwrap_err();
//! assert!(err.to_string().contains("unknown field `formt`"), "{err}");
//! ```

use outbox_types::SinkError;
use outbox_types::sink_config::config_error;

/// The routing headers with each name kept once, first occurrence wins, names compared without
/// case. The event's own headers come after the standard ones, so an own `Outbox-Event-Id`
/// (which routing's case-sensitive `outbox-` filter lets through) cannot shadow the real one.
///
/// ```
/// let headers = vec![
///     ("outbox-event-id".to_owned(), "real".to_owned()),
///     ("Outbox-Event-Id".to_owned(), "forged".to_owned()),
/// ];
/// assert_eq!(
///     outbox_sink_common::unique_headers(headers),
///     vec![("outbox-event-id".to_owned(), "real".to_owned())]
/// );
/// ```
pub fn unique_headers(headers: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut seen = std::collections::HashSet::with_capacity(headers.len());
    headers
        .into_iter()
        .filter(|(name, _)| seen.insert(name.to_ascii_lowercase()))
        .collect()
}

/// Who a sink logs in as, from its `user`, its password and its token (resolved from their
/// inline and `*_env` keys): a user with a password, a token, or nobody.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Login {
    /// No credentials are configured.
    Anonymous,
    /// `user` with its password.
    UserPassword {
        /// The user name.
        user: String,
        /// The password, resolved.
        password: String,
    },
    /// A token (NATS `token`, HTTP `bearer_token`), resolved.
    Token(String),
}

/// The [`Login`] that `user`, `password` and `token` describe, for the sinks that take either a
/// user with a password or a token (NATS, HTTP). Half of a user login or both kinds at once is
/// a configuration error that names the fix, worded the same in every such sink; `both` is the
/// sink's own message for both kinds at once, naming its token key.
///
/// ```
/// use outbox_sink_common::{Login, login};
///
/// let both = "both `user`/`password` and `token` are set: keep one";
/// assert_eq!(login(None, None, None, both).unwrap(), Login::Anonymous);
/// assert_eq!(login(None, None, Some("t".into()), both).unwrap(), Login::Token("t".into()));
/// let err = login(Some("u".into()), None, None, both).unwrap_err();
/// assert!(err.to_string().contains("password_env"), "{err}");
/// let err = login(None, Some("p".into()), Some("t".into()), both).unwrap_err();
/// assert!(err.to_string().contains("keep one"), "{err}");
/// ```
pub fn login(
    user: Option<String>,
    password: Option<String>,
    token: Option<String>,
    both: &str,
) -> Result<Login, SinkError> {
    match (user, password, token) {
        (Some(_), _, Some(_)) | (None, Some(_), Some(_)) => Err(config_error(both)),
        (None, Some(_), None) => Err(config_error(
            "a password is set but `user` is not: add `user = \"…\"`",
        )),
        (Some(_), None, None) => Err(config_error(
            "`user` is set without a password: add `password_env = \"VAR\"` (or `password`)",
        )),
        (Some(user), Some(password), None) => Ok(Login::UserPassword { user, password }),
        (None, None, Some(token)) => Ok(Login::Token(token)),
        (None, None, None) => Ok(Login::Anonymous),
    }
}

/// A secret setting, given inline as the field `$inline` of `$config` or through the
/// environment variable its field `$env` names ([`outbox_types::sink_config::secret`]). The
/// keys an error names are the two fields' names, so they cannot drift from the settings the
/// user wrote; a function could not know them.
///
/// ```
/// use outbox_types::redact::Secret;
///
/// struct Settings {
///     token: Option<Secret>,
///     token_env: Option<String>,
/// }
/// let both = Settings { token: Some(Secret::new("t")), token_env: Some("VAR".into()) };
/// let err = outbox_sink_common::secret!(both, token, token_env).unwrap_err();
/// assert!(err.to_string().contains("both `token` and `token_env` are set"), "{err}");
/// let inline = Settings { token: Some(Secret::new("t")), token_env: None };
/// assert_eq!(outbox_sink_common::secret!(inline, token, token_env).unwrap().as_deref(), Some("t"));
/// ```
#[macro_export]
macro_rules! secret {
    ($config:expr, $inline:ident, $env:ident) => {
        $crate::__private::sink_config::secret(
            stringify!($inline),
            $config.$inline.as_ref(),
            stringify!($env),
            $config.$env.as_deref(),
        )
    };
}

/// What the macros' expansions name, reachable from every crate that calls them.
#[doc(hidden)]
pub mod __private {
    pub use outbox_types::redact::Secret;
    pub use outbox_types::routing::{BodyFormat, CloudEventsKeys, CloudEventsMode};
    pub use outbox_types::sink_config;
}

/// Declare a sink's settings struct and its `Default` impl (see the [crate docs](crate)).
///
/// Inside the braces, each field is written as usual (doc comments and attributes, then
/// `pub name: Type`) followed by `= default,`. These markers stand for shared fields:
///
/// - `@format,` — `format: BodyFormat` (`raw` by default);
/// - `@cloudevents,` — `cloudevents_source`, `cloudevents_mode` and `cloudevents_type_prefix`
///   (all unset by default), and a method `cloudevents_keys()` that hands them to
///   [`outbox_types::sink_config::routing`];
/// - `@username,` — `username`, the old spelling of `user`, read but never printed (for
///   [`outbox_types::sink_config::user`]).
/// - `@password,` — `password` (a [`Secret`](outbox_types::redact::Secret), masked when printed)
///   and `password_env` (both unset by default), for [`outbox_types::sink_config::password`].
#[macro_export]
macro_rules! config_struct {
    // `@format`: the body format.
    (@munch $name:ident $head:tt [$($fields:tt)*] [$($defaults:tt)*] @format, $($rest:tt)*) => {
        $crate::config_struct!(@munch $name $head
            [$($fields)*
                /// `raw` (default), `cloudevents` or `debezium` (the message shape of Debezium's Outbox
                /// Event Router, for its consumers).
                pub format: $crate::__private::BodyFormat,
            ]
            [$($defaults)* format: $crate::__private::BodyFormat::Raw,]
            $($rest)*);
    };
    // `@cloudevents`: the keys of `format = "cloudevents"`.
    (@munch $name:ident $head:tt [$($fields:tt)*] [$($defaults:tt)*] @cloudevents, $($rest:tt)*) => {
        impl $name {
            /// The `cloudevents_*` keys, as [`outbox_types::sink_config::routing`] reads them.
            pub(crate) fn cloudevents_keys(&self) -> $crate::__private::CloudEventsKeys<'_> {
                $crate::__private::CloudEventsKeys {
                    source: self.cloudevents_source.as_deref(),
                    mode: self.cloudevents_mode,
                    type_prefix: self.cloudevents_type_prefix.as_deref(),
                }
            }
        }
        $crate::config_struct!(@munch $name $head
            [$($fields)*
                /// The CloudEvents `source` attribute (e.g. `/orders-service`); required with
                /// `format = "cloudevents"`.
                pub cloudevents_source: Option<String>,
                /// `structured` (default: one JSON envelope as the body) or `binary` (the payload as the
                /// body, the attributes as headers named by the protocol's CloudEvents binding); only with
                /// `format = "cloudevents"`.
                pub cloudevents_mode: Option<$crate::__private::CloudEventsMode>,
                /// Put before the event type in the CloudEvents `type` (reverse-DNS, e.g.
                /// `com.example.orders` gives `com.example.orders.OrderCreated`); only with
                /// `format = "cloudevents"`.
                pub cloudevents_type_prefix: Option<String>,
            ]
            [$($defaults)* cloudevents_source: None, cloudevents_mode: None, cloudevents_type_prefix: None,]
            $($rest)*);
    };
    // `@username`: the old spelling of `user`.
    (@munch $name:ident $head:tt [$($fields:tt)*] [$($defaults:tt)*] @username, $($rest:tt)*) => {
        $crate::config_struct!(@munch $name $head
            [$($fields)*
                /// The old spelling of `user`: still read, with a deprecation warning.
                #[serde(skip_serializing)]
                pub username: Option<String>,
            ]
            [$($defaults)* username: None,]
            $($rest)*);
    };
    // `@password`: the password for `user`, given or read from the environment.
    (@munch $name:ident $head:tt [$($fields:tt)*] [$($defaults:tt)*] @password, $($rest:tt)*) => {
        $crate::config_struct!(@munch $name $head
            [$($fields)*
                /// Password for `user`.
                pub password: Option<$crate::__private::Secret>,
                /// Name of an environment variable holding the password.
                pub password_env: Option<String>,
            ]
            [$($defaults)* password: None, password_env: None,]
            $($rest)*);
    };
    // A sink's own field, with its default.
    (@munch $name:ident $head:tt [$($fields:tt)*] [$($defaults:tt)*]
        $(#[$field_meta:meta])* $field_vis:vis $field:ident : $ty:ty = $default:expr, $($rest:tt)*) => {
        $crate::config_struct!(@munch $name $head
            [$($fields)* $(#[$field_meta])* $field_vis $field: $ty,]
            [$($defaults)* $field: $default,]
            $($rest)*);
    };
    // Every field read: the struct and its defaults.
    (@munch $name:ident [$(#[$meta:meta])* $vis:vis] [$($fields:tt)*] [$($defaults:tt)*]) => {
        $(#[$meta])*
        $vis struct $name {
            $($fields)*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $($defaults)* }
            }
        }
    };
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($body:tt)* }) => {
        $crate::config_struct!(@munch $name [$(#[$meta])* $vis] [] [] $($body)*);
    };
}
