//! [`impl_table_outbox!`](crate::impl_table_outbox): the outbox location of a store whose outbox
//! is one table of the connection's database (`outbox-mysql`, `outbox-sqlite`): the table name,
//! checked once and quoted everywhere, and the statements rendered for it once.
//!
//! Why a macro: the MySQL and SQLite stores carried the same type word for word (the same
//! fields, constructors and template rendering), differing only in the identifier quote, the
//! name check and their `Sql`, which is each store's own SQL text; a fix to one copy missed the
//! other. The type is public in each store crate, so it is expanded there.

/// Define the public outbox location `$name` (cheap to clone: an `Arc` of the names and the
/// rendered `Sql`) and its crate-private `Names`, with `Default`, `new` (the table `$default`),
/// `with_table` (refused by `$check` unless plain; documented by the caller), `table`,
/// `quoted_table` (quoted with `$quote`), and, for the store's own use, `migrations_table`
/// (`<table>_migrations`, quoted), `render` (a template's `{t}` and `{table}` replaced) and
/// `sql`. `$render` builds the `$sql` statements from the quoted and the bare table name.
/// The store adds its migration methods in an `impl` of its own.
#[macro_export]
macro_rules! impl_table_outbox {
    (
        $(#[$doc:meta])*
        pub struct $name:ident;
        default: $default:ident,
        quote: $quote:literal,
        check: $check:path,
        sql: $sql:ty = $render:path,
        $(#[$with_doc:meta])*
        fn with_table;
    ) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name {
            pub(crate) inner: ::std::sync::Arc<Names>,
        }

        #[derive(Debug)]
        pub(crate) struct Names {
            pub(crate) table: String,
            pub(crate) quoted: String,
            pub(crate) sql: $sql,
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl $name {
            #[doc = concat!("The outbox in table [`", stringify!($default), "`].")]
            pub fn new() -> Self {
                Self::with_table($default)
                    .unwrap_or_else(|_| unreachable!("the default is valid"))
            }

            $(#[$with_doc])*
            pub fn with_table(table: &str) -> Result<Self, $crate::StoreError> {
                $check(table)?;
                let quoted = format!("{q}{table}{q}", q = $quote);
                let sql = $render(&quoted, table);
                Ok($name {
                    inner: ::std::sync::Arc::new(Names {
                        table: table.to_owned(),
                        quoted,
                        sql,
                    }),
                })
            }

            /// The table name.
            pub fn table(&self) -> &str {
                &self.inner.table
            }

            #[doc = concat!("`` ", $quote, "table", $quote, " ``, ready to use in SQL.")]
            pub fn quoted_table(&self) -> &str {
                &self.inner.quoted
            }

            pub(crate) fn migrations_table(&self) -> String {
                format!("{q}{}_migrations{q}", self.inner.table, q = $quote)
            }

            pub(crate) fn render(&self, template: &str) -> String {
                template
                    .replace("{t}", &self.inner.quoted)
                    .replace("{table}", &self.inner.table)
            }

            pub(crate) fn sql(&self) -> &$sql {
                &self.inner.sql
            }
        }
    };
}
