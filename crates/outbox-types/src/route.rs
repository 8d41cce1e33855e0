//! Which destination an event goes to, when a relay serves several.
//!
//! A relay daemon serves services written in any language, so it cannot ask the writer's code
//! where an event belongs: it reads it from the event's own fields. A [`RouteTable`] decides, in
//! this order:
//!
//! 1. the event's `destination` column, when it names one of the configured destinations;
//! 2. the first [`RouteRule`] whose patterns all match the event (`event_type`,
//!    `aggregate_type`, and the `destination` column, each exact, `prefix*`, or `*`);
//! 3. nothing: the event is *unroutable* (the relay dead-letters it with an error that says
//!    which rule to add; `outbox dead requeue` sends it again once one exists).
//!
//! The same decision is needed in two places: in the relay, per claimed event, and inside the
//! database, where a claim must skip the events of a paused destination and `outbox status`
//! counts the backlog per destination without reading every row out. [`RouteTable::sql_case`]
//! renders the table as one SQL `CASE` expression with bound parameters, so the two always
//! agree (patterns are byte-exact, which is what [`Pattern::matches`] does in Rust).
//!
//! ```
//! use outbox_types::route::{Pattern, RouteRule, RouteTable};
//!
//! let routes = RouteTable::new(
//!     ["orders", "audit"],
//!     vec![
//!         RouteRule::to("audit").event_type(Pattern::parse("Audit*")),
//!         RouteRule::to("orders"),
//!     ],
//! )
//! .unwrap();
//! assert_eq!(routes.resolve("AuditLogged", "user", None), Some("audit"));
//! assert_eq!(routes.resolve("OrderCreated", "order", None), Some("orders"));
//! // The event's own destination column wins when it names a destination.
//! assert_eq!(routes.resolve("AuditLogged", "user", Some("orders")), Some("orders"));
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::event::Event;

/// A match over one text field: the whole value, a prefix (`Order*`), or anything (`*`).
///
/// Only a trailing `*` is special; matching is byte-exact (case-sensitive), in Rust and in SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Any value, including an absent one.
    Any,
    /// Exactly this value.
    Exact(String),
    /// Values starting with this text.
    Prefix(String),
}

impl Pattern {
    /// `*` → [`Pattern::Any`], `Order*` → [`Pattern::Prefix`], anything else exact.
    pub fn parse(text: &str) -> Self {
        if text == "*" {
            Pattern::Any
        } else if let Some(prefix) = text.strip_suffix('*') {
            Pattern::Prefix(prefix.to_owned())
        } else {
            Pattern::Exact(text.to_owned())
        }
    }

    /// Whether `value` matches. An absent value matches only [`Pattern::Any`].
    pub fn matches(&self, value: Option<&str>) -> bool {
        match (self, value) {
            (Pattern::Any, _) => true,
            (_, None) => false,
            (Pattern::Exact(x), Some(v)) => v == x,
            (Pattern::Prefix(p), Some(v)) => v.starts_with(p.as_str()),
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Any => f.write_str("*"),
            Pattern::Exact(x) => f.write_str(x),
            Pattern::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

impl Serialize for Pattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Pattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Pattern::parse(&String::deserialize(d)?))
    }
}

/// One rule: events whose fields match every pattern given go to `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteRule {
    /// Pattern over the event type; `None` matches any.
    pub event_type: Option<Pattern>,
    /// Pattern over the aggregate type; `None` matches any.
    pub aggregate_type: Option<Pattern>,
    /// Pattern over the event's `destination` column; `None` matches any (set or not).
    pub destination: Option<Pattern>,
    /// The destination events matching this rule go to.
    pub to: String,
}

impl RouteRule {
    /// A rule that sends every event to `to` (refine it with the builder methods).
    pub fn to(to: impl Into<String>) -> Self {
        RouteRule {
            event_type: None,
            aggregate_type: None,
            destination: None,
            to: to.into(),
        }
    }

    /// Match on the event type too.
    pub fn event_type(mut self, pattern: Pattern) -> Self {
        self.event_type = Some(pattern);
        self
    }

    /// Match on the aggregate type too.
    pub fn aggregate_type(mut self, pattern: Pattern) -> Self {
        self.aggregate_type = Some(pattern);
        self
    }

    /// Match on the event's `destination` column too.
    pub fn destination(mut self, pattern: Pattern) -> Self {
        self.destination = Some(pattern);
        self
    }

    fn matches(&self, event_type: &str, aggregate_type: &str, destination: Option<&str>) -> bool {
        self.event_type
            .as_ref()
            .is_none_or(|p| p.matches(Some(event_type)))
            && self
                .aggregate_type
                .as_ref()
                .is_none_or(|p| p.matches(Some(aggregate_type)))
            && self
                .destination
                .as_ref()
                .is_none_or(|p| p.matches(destination))
    }
}

/// A route table that cannot work; the message names the rule and the fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct RouteError(pub String);

/// The configured destinations and the rules that pick one per event. See the module docs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteTable {
    destinations: Vec<String>,
    rules: Vec<RouteRule>,
}

impl RouteTable {
    /// A table over `destinations` (names) with `rules` tried in order.
    ///
    /// With exactly one destination and no rules, every event goes to that destination. Every
    /// rule must point at a configured destination.
    pub fn new<I, N>(destinations: I, mut rules: Vec<RouteRule>) -> Result<Self, RouteError>
    where
        I: IntoIterator<Item = N>,
        N: Into<String>,
    {
        let destinations: Vec<String> = destinations.into_iter().map(Into::into).collect();
        if destinations.is_empty() {
            return Err(RouteError(
                "no destination is configured: add a `[destinations.NAME]` table".into(),
            ));
        }
        for (i, rule) in rules.iter().enumerate() {
            if !destinations.contains(&rule.to) {
                return Err(RouteError(format!(
                    "route #{} sends events to `{}`, which is not a configured destination (configured: {})",
                    i + 1,
                    rule.to,
                    destinations.join(", ")
                )));
            }
        }
        if rules.is_empty() && destinations.len() == 1 {
            rules.push(RouteRule::to(destinations[0].clone()));
        }
        Ok(RouteTable {
            destinations,
            rules,
        })
    }

    /// One destination that receives every event.
    pub fn single(destination: impl Into<String>) -> Self {
        let name = destination.into();
        RouteTable {
            rules: vec![RouteRule::to(name.clone())],
            destinations: vec![name],
        }
    }

    /// The configured destination names.
    pub fn destinations(&self) -> &[String] {
        &self.destinations
    }

    /// The rules, in the order they are tried.
    pub fn rules(&self) -> &[RouteRule] {
        &self.rules
    }

    /// Whether `name` is a configured destination.
    pub fn contains(&self, name: &str) -> bool {
        self.destinations.iter().any(|d| d == name)
    }

    /// The destination of an event with these fields, or `None` when nothing matches.
    pub fn resolve(
        &self,
        event_type: &str,
        aggregate_type: &str,
        destination: Option<&str>,
    ) -> Option<&str> {
        if let Some(named) = destination.and_then(|d| self.destinations.iter().find(|n| *n == d)) {
            return Some(named);
        }
        self.rules
            .iter()
            .find(|r| r.matches(event_type, aggregate_type, destination))
            .map(|r| r.to.as_str())
    }

    /// [`RouteTable::resolve`] for a claimed event.
    pub fn resolve_event(&self, event: &Event) -> Option<&str> {
        self.resolve(
            &event.event_type,
            &event.aggregate_type,
            event.destination.as_deref(),
        )
    }

    /// The table as one SQL expression over the columns `destination`, `event_type` and
    /// `aggregate_type` (optionally qualified by `alias`) that yields the destination name, or
    /// the empty string for an unroutable event. Values are bound parameters, never spliced in.
    pub fn sql_case(&self, dialect: SqlDialect, alias: Option<&str>) -> SqlFragment {
        let mut out = SqlFragment::new(dialect);
        let col = |name: &str| match alias {
            Some(a) => format!("{a}.{name}"),
            None => name.to_owned(),
        };
        out.sql.push_str("(CASE");
        if !self.destinations.is_empty() {
            out.sql.push_str(" WHEN ");
            out.sql.push_str(&col("destination"));
            out.sql.push_str(" IN (");
            for (i, d) in self.destinations.iter().enumerate() {
                if i > 0 {
                    out.sql.push_str(", ");
                }
                out.push_bind(d);
            }
            out.sql.push_str(") THEN ");
            out.sql.push_str(&col("destination"));
        }
        for rule in &self.rules {
            let mut conditions = Vec::new();
            for (pattern, column) in [
                (&rule.event_type, "event_type"),
                (&rule.aggregate_type, "aggregate_type"),
                (&rule.destination, "destination"),
            ] {
                if let Some(p) = pattern {
                    match p {
                        Pattern::Any => {}
                        Pattern::Exact(x) => {
                            let mut c = dialect.exact(&col(column));
                            c = out.bind_into(&c, &[x]);
                            conditions.push(c);
                        }
                        Pattern::Prefix(x) => {
                            let c = dialect.prefix(&col(column));
                            let binds = vec![x.as_str(); c.matches(SqlDialect::HOLE).count()];
                            conditions.push(out.bind_into(&c, &binds));
                        }
                    }
                }
            }
            out.sql.push_str(" WHEN ");
            if conditions.is_empty() {
                out.sql.push_str("1 = 1");
            } else {
                out.sql.push_str(&conditions.join(" AND "));
            }
            out.sql.push_str(" THEN ");
            out.push_bind(&rule.to);
        }
        out.sql.push_str(" ELSE '' END)");
        out
    }
}

/// The SQL flavour a [`SqlFragment`] is rendered for: placeholders and string functions differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SqlDialect {
    /// `$n` placeholders numbered from the given start.
    Postgres {
        /// The number of the first placeholder this fragment may use.
        first_param: usize,
    },
    /// `?` placeholders.
    Sqlite,
    /// `?` placeholders; comparisons made binary (case- and accent-sensitive).
    MySql,
}

impl SqlDialect {
    const HOLE: &'static str = "\u{1}";

    fn exact(self, column: &str) -> String {
        match self {
            SqlDialect::MySql => format!("{column} = BINARY {}", Self::HOLE),
            _ => format!("{column} = {}", Self::HOLE),
        }
    }

    fn prefix(self, column: &str) -> String {
        let h = Self::HOLE;
        match self {
            SqlDialect::Postgres { .. } => format!("starts_with({column}, {h})"),
            SqlDialect::Sqlite => format!("substr({column}, 1, length({h})) = {h}"),
            SqlDialect::MySql => {
                format!("LEFT({column}, CHAR_LENGTH({h})) = BINARY {h}")
            }
        }
    }
}

/// A piece of SQL and the values for its placeholders, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SqlFragment {
    /// The SQL text.
    pub sql: String,
    /// Values to bind, in placeholder order.
    pub binds: Vec<String>,
    dialect: SqlDialect,
}

impl SqlFragment {
    fn new(dialect: SqlDialect) -> Self {
        SqlFragment {
            sql: String::new(),
            binds: Vec::new(),
            dialect,
        }
    }

    /// The placeholder for the next bind.
    fn placeholder(&self) -> String {
        match self.dialect {
            SqlDialect::Postgres { first_param } => {
                format!("${}", first_param + self.binds.len())
            }
            SqlDialect::Sqlite | SqlDialect::MySql => "?".to_owned(),
        }
    }

    fn push_bind(&mut self, value: &str) {
        let p = self.placeholder();
        self.sql.push_str(&p);
        self.binds.push(value.to_owned());
    }

    /// Replace each hole in `template` by a placeholder bound to the next of `values`.
    fn bind_into(&mut self, template: &str, values: &[&str]) -> String {
        let mut result = String::new();
        let mut values = values.iter();
        let mut parts = template.split(SqlDialect::HOLE).peekable();
        while let Some(part) = parts.next() {
            result.push_str(part);
            if parts.peek().is_some() {
                let p = self.placeholder();
                result.push_str(&p);
                self.binds
                    .push(values.next().map(|v| (*v).to_owned()).unwrap_or_default());
            }
        }
        result
    }

    /// The number of placeholders used (for a PostgreSQL statement that continues after it).
    pub fn len(&self) -> usize {
        self.binds.len()
    }

    /// Whether the fragment binds nothing.
    pub fn is_empty(&self) -> bool {
        self.binds.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RouteTable {
        RouteTable::new(
            ["kafka", "hooks", "audit"],
            vec![
                RouteRule::to("audit").event_type(Pattern::parse("Audit*")),
                RouteRule::to("hooks")
                    .aggregate_type(Pattern::parse("partner"))
                    .destination(Pattern::parse("https://*")),
                RouteRule::to("kafka").aggregate_type(Pattern::parse("order")),
            ],
        )
        .unwrap()
    }

    #[test]
    fn first_matching_rule_wins_and_a_named_destination_overrides() {
        let t = table();
        assert_eq!(t.resolve("AuditLogged", "order", None), Some("audit"));
        assert_eq!(t.resolve("OrderCreated", "order", None), Some("kafka"));
        assert_eq!(
            t.resolve("Ping", "partner", Some("https://x.example/hook")),
            Some("hooks")
        );
        assert_eq!(t.resolve("Ping", "partner", None), None);
        assert_eq!(t.resolve("Ping", "user", None), None);
        assert_eq!(
            t.resolve("AuditLogged", "user", Some("kafka")),
            Some("kafka")
        );
        // A destination column that names no destination is only a topic hint.
        assert_eq!(
            t.resolve("OrderCreated", "order", Some("orders.v2")),
            Some("kafka")
        );
    }

    #[test]
    fn rules_must_name_configured_destinations() {
        let err = RouteTable::new(["kafka"], vec![RouteRule::to("kafak")]).unwrap_err();
        assert!(err.0.contains("route #1"), "{err}");
        assert!(err.0.contains("`kafak`"), "{err}");
        assert!(RouteTable::new(Vec::<String>::new(), vec![]).is_err());
    }

    #[test]
    fn one_destination_without_rules_takes_everything() {
        let t = RouteTable::new(["only"], vec![]).unwrap();
        assert_eq!(t.resolve("X", "y", None), Some("only"));
        assert_eq!(t.resolve("X", "y", Some("topic")), Some("only"));
        // Two destinations and no rules: only named events are routable.
        let t = RouteTable::new(["a", "b"], vec![]).unwrap();
        assert_eq!(t.resolve("X", "y", None), None);
        assert_eq!(t.resolve("X", "y", Some("b")), Some("b"));
    }

    #[test]
    fn patterns() {
        assert!(Pattern::parse("*").matches(None));
        assert!(Pattern::parse("Order*").matches(Some("OrderCreated")));
        assert!(!Pattern::parse("Order*").matches(Some("order")));
        assert!(Pattern::parse("Order*").matches(Some("Order")));
        assert!(!Pattern::parse("Order").matches(Some("OrderCreated")));
        assert!(!Pattern::parse("Order").matches(None));
        assert_eq!(Pattern::parse("a*").to_string(), "a*");
    }

    #[test]
    fn sql_case_binds_every_value_in_order() {
        let t = table();
        let pg = t.sql_case(SqlDialect::Postgres { first_param: 3 }, Some("e"));
        assert_eq!(
            pg.sql,
            "(CASE WHEN e.destination IN ($3, $4, $5) THEN e.destination \
             WHEN starts_with(e.event_type, $6) THEN $7 \
             WHEN e.aggregate_type = $8 AND starts_with(e.destination, $9) THEN $10 \
             WHEN e.aggregate_type = $11 THEN $12 ELSE '' END)"
        );
        assert_eq!(
            pg.binds,
            [
                "kafka", "hooks", "audit", "Audit", "audit", "partner", "https://", "hooks",
                "order", "kafka"
            ]
        );
        let lite = t.sql_case(SqlDialect::Sqlite, None);
        assert!(
            lite.sql
                .contains("WHEN substr(event_type, 1, length(?)) = ? THEN ?"),
            "{}",
            lite.sql
        );
        assert_eq!(lite.binds.len(), lite.sql.matches('?').count());
        assert_eq!(&lite.binds[3..6], ["Audit", "Audit", "audit"]);
        let my = t.sql_case(SqlDialect::MySql, None);
        assert!(my.sql.contains("aggregate_type = BINARY ?"), "{}", my.sql);
        assert_eq!(my.binds.len(), my.sql.matches('?').count());
        let catch_all = RouteTable::single("x").sql_case(SqlDialect::Sqlite, None);
        assert_eq!(
            catch_all.sql,
            "(CASE WHEN destination IN (?) THEN destination WHEN 1 = 1 THEN ? ELSE '' END)"
        );
    }
}
