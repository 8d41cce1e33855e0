//! The part of a migration runner that is not SQL: the [`Migration`] list entry, its checksum,
//! the decision which migrations still have to run, and the [`MigrationReport`].
//!
//! Why here: every store (PostgreSQL, MySQL, SQLite) and every inbox backend keeps its own
//! versioned SQL templates and its own bookkeeping table (`<table>_migrations`), because the
//! table name is configurable and `sqlx::migrate!` cannot follow it. The SQL, the locking
//! (an advisory lock, `GET_LOCK`, `BEGIN IMMEDIATE`) and the transaction differ per database;
//! what a runner decides from the rows it read does not: a version the build does not know
//! means the database is newer than the code, a checksum that differs means a released
//! migration was edited, and both stop the runner with the same words everywhere. That decision
//! lives here once, with no I/O, so each runner only reads rows and applies what [`pending`]
//! returns.
//!
//! ```
//! use outbox_types::migration::{Migration, Schema, pending};
//!
//! const MIGRATIONS: &[Migration] = &[
//!     Migration { version: 1, description: "create", sql: "CREATE TABLE t (x INT)" },
//!     Migration { version: 2, description: "index", sql: "CREATE INDEX t_x ON t (x)" },
//! ];
//! let applied = [(1, MIGRATIONS[0].checksum())];
//! let todo = pending(Schema::OUTBOX, MIGRATIONS, &applied).unwrap();
//! assert_eq!(todo.iter().map(|m| m.version).collect::<Vec<_>>(), [2]);
//!
//! let edited = [(1, "0000000000000000".to_owned())];
//! let error = pending(Schema::OUTBOX, MIGRATIONS, &edited).unwrap_err();
//! assert!(error.to_string().contains("must never be edited once released"));
//! ```

use crate::StoreError;
use crate::sql_store::fnv1a;

/// One schema change: a version, a description for the bookkeeping table, and a SQL template
/// whose placeholders (the table name, …) the store replaces before it runs. The checksum is
/// taken over the template, so it is the same whatever the table is called.
#[derive(Clone, Copy, Debug)]
pub struct Migration {
    /// The version, counting up from 1.
    pub version: i64,
    /// What it does, in a few words (stored in the bookkeeping table).
    pub description: &'static str,
    /// The SQL template.
    pub sql: &'static str,
}

impl Migration {
    /// The checksum recorded when the migration is applied: [`checksum`] of the template.
    pub fn checksum(&self) -> String {
        checksum(self.sql)
    }
}

/// What a runner needs to know about a migration to decide whether to apply it: its list entry
/// (the version, the description a checksum-mismatch error names, the SQL) and its checksum.
/// [`Migration`] is its own entry; a store whose migrations carry more (MySQL's columns to add)
/// keeps a [`Migration`] inside its own type and gives its own checksum text.
pub trait Versioned {
    /// The version, the description and the SQL template.
    fn entry(&self) -> &Migration;
    /// The checksum recorded when it is applied: the entry's [`Migration::checksum`] unless the
    /// store's migration carries more than its SQL.
    fn checksum(&self) -> String {
        self.entry().checksum()
    }
}

impl Versioned for Migration {
    fn entry(&self) -> &Migration {
        self
    }
}

/// The checksum of a migration's text: a 64-bit FNV-1a hash as 16 hex digits, stable across
/// builds and platforms.
///
/// ```
/// assert_eq!(outbox_types::migration::checksum(""), "cbf29ce484222325");
/// ```
pub fn checksum(text: &str) -> String {
    format!("{:016x}", fnv1a(text))
}

/// The newest version in `known` (`0` for none).
pub fn latest_version<M: Versioned>(known: &[M]) -> i64 {
    known.last().map(|m| m.entry().version).unwrap_or(0)
}

/// Whose schema a runner migrates, as its errors name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schema {
    /// The schema's name in messages: `outbox`, `inbox`.
    pub name: &'static str,
    /// What to do about a database newer than the build.
    pub upgrade: &'static str,
}

impl Schema {
    /// The outbox table of a store.
    pub const OUTBOX: Schema = Schema {
        name: "outbox",
        upgrade: "upgrade the outbox binary or library",
    };
    /// The inbox table of `outbox-inbox`.
    pub const INBOX: Schema = Schema {
        name: "inbox",
        upgrade: "upgrade outbox-inbox",
    };
}

/// Why a runner refuses to migrate.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The database records a version this build does not know: it is newer than the code.
    #[error(
        "the database has {schema} schema version {version}, newer than this build knows ({latest}); {upgrade}"
    )]
    Newer {
        /// [`Schema::name`].
        schema: &'static str,
        /// The unknown version.
        version: i64,
        /// The newest version this build knows.
        latest: i64,
        /// [`Schema::upgrade`].
        upgrade: &'static str,
    },
    /// An applied migration's recorded checksum differs from this build's: it was edited.
    #[error(
        "{schema} migration {version} ({description}) differs from the one applied to the database; migrations must never be edited once released"
    )]
    Edited {
        /// [`Schema::name`].
        schema: &'static str,
        /// The edited version.
        version: i64,
        /// Its description.
        description: &'static str,
    },
}

impl From<PlanError> for StoreError {
    fn from(error: PlanError) -> Self {
        StoreError::NotMigrated(error.to_string())
    }
}

/// The migrations of `known` still to apply, oldest first, given the `(version, checksum)` rows
/// of the bookkeeping table. An applied version this build does not know, or one whose checksum
/// differs, is an error (checked in the order of `applied`), and nothing is to be applied.
pub fn pending<'m, M: Versioned>(
    schema: Schema,
    known: &'m [M],
    applied: &[(i64, String)],
) -> Result<Vec<&'m M>, PlanError> {
    for (version, recorded) in applied {
        match known.iter().find(|m| m.entry().version == *version) {
            None => {
                return Err(PlanError::Newer {
                    schema: schema.name,
                    version: *version,
                    latest: latest_version(known),
                    upgrade: schema.upgrade,
                });
            }
            Some(m) if Versioned::checksum(m) != *recorded => {
                return Err(PlanError::Edited {
                    schema: schema.name,
                    version: *version,
                    description: m.entry().description,
                });
            }
            Some(_) => {}
        }
    }
    Ok(known
        .iter()
        .filter(|m| !applied.iter().any(|(v, _)| *v == m.entry().version))
        .collect())
}

/// The error of a store's `check` when the schema in the database (`current`) is older than
/// the build (`latest`); `place` says where it is (`"outbox"."events"`, `table "events"`).
///
/// ```
/// use outbox_types::migration::{Schema, check_current};
/// assert!(check_current(Schema::OUTBOX, "table `e`", 4, 4).is_ok());
/// let err = check_current(Schema::OUTBOX, "table `e`", 3, 4).unwrap_err();
/// assert!(err.to_string().contains("outbox schema in table `e` is at version 3, this build needs 4"));
/// ```
pub fn check_current(
    schema: Schema,
    place: &str,
    current: i64,
    latest: i64,
) -> Result<(), StoreError> {
    if current < latest {
        return Err(StoreError::NotMigrated(format!(
            "{} schema in {place} is at version {current}, this build needs {latest}",
            schema.name
        )));
    }
    Ok(())
}

/// Whether `known` still holds the `released` migrations, `(version, checksum)` in order: the
/// error names the first one whose text changed (or that is gone) and lists what `known` has.
/// Each store's tests pin its released migrations with it: a database that applied one checks
/// its checksum on every migrate, so a changed text (a comment is enough) would stop every
/// existing outbox from upgrading.
///
/// ```
/// use outbox_types::migration::{Migration, check_released};
/// let known = [Migration { version: 1, description: "create", sql: "SELECT 1" }];
/// assert!(check_released(&known, &[(1, known[0].checksum().as_str())]).is_ok());
/// assert!(check_released(&known, &[(1, "0000000000000000")]).is_err());
/// ```
pub fn check_released<M: Versioned>(known: &[M], released: &[(i64, &str)]) -> Result<(), String> {
    let got: Vec<(i64, String)> = known
        .iter()
        .map(|m| (m.entry().version, Versioned::checksum(m)))
        .collect();
    for (i, (version, checksum)) in released.iter().enumerate() {
        if got.get(i) != Some(&(*version, (*checksum).to_owned())) {
            return Err(format!(
                "migration {version} changed after its release: {got:?}"
            ));
        }
    }
    Ok(())
}

/// The bookkeeping table on PostgreSQL, as SQL that creates the schema `schema` and the table
/// `bookkeeping` (its quoted, qualified name) when they are missing: the same table for every
/// runner there (a store's outbox, an inbox).
pub fn postgres_bookkeeping_ddl(schema: &str, bookkeeping: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
CREATE TABLE IF NOT EXISTS {bookkeeping} (
    version     BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    checksum    TEXT NOT NULL,
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);"
    )
}

/// The bookkeeping table on SQLite, as SQL that creates the table `bookkeeping` (its quoted
/// name) when it is missing: the same table for every runner there (a store's outbox, an inbox).
/// `applied_at` is microseconds since the Unix epoch, written by the runner (no default).
pub fn sqlite_bookkeeping_ddl(bookkeeping: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {bookkeeping} (
    version     INTEGER PRIMARY KEY,
    description TEXT    NOT NULL,
    checksum    TEXT    NOT NULL,
    applied_at  INTEGER NOT NULL
) STRICT;"
    )
}

/// The `(version, checksum)` rows of the bookkeeping table `$bookkeeping` (its quoted name),
/// oldest first, read through `$conn`: what [`pending`] takes. The statement is the same in
/// every database; errors go through `$map_err` (the store's `map_sqlx`). A macro because the
/// connection is the driver's (`sqlx`, which the caller depends on).
#[macro_export]
macro_rules! applied_migrations {
    ($conn:expr, $bookkeeping:expr, $map_err:path) => {
        ::sqlx::query_as(::sqlx::AssertSqlSafe(format!(
            "SELECT version, checksum FROM {} ORDER BY version",
            $bookkeeping
        )))
        .fetch_all($conn)
        .await
        .map_err($map_err)
    };
}

/// The schema version a store's database is at: `0` when `$exists`, a `query_scalar` that
/// counts the bookkeeping table in the catalog (0 or 1), finds no such table (the outbox was
/// never migrated there), else the newest version recorded in `$bookkeeping` (its quoted name),
/// `0` when it holds none; both read through `$pool`. What a store's `current_version` reports;
/// the statement that reads the versions is the same in every database, errors go through
/// `$map_err` (the store's `map_sqlx`). A macro for the reason [`applied_migrations!`] is one.
#[macro_export]
macro_rules! recorded_version {
    ($pool:expr, $exists:expr, $bookkeeping:expr, $map_err:path) => {
        match $exists.fetch_one($pool).await.map_err($map_err) {
            Err(error) => Err(error),
            Ok(0_i64) => Ok(0),
            Ok(_) => ::sqlx::query_scalar::<_, Option<i64>>(::sqlx::AssertSqlSafe(format!(
                "SELECT max(version) FROM {}",
                $bookkeeping
            )))
            .fetch_one($pool)
            .await
            .map(|version| version.unwrap_or(0))
            .map_err($map_err),
        }
    };
}

/// Record the migration `$m` (a [`Versioned`]) applied through `$conn`: `$insert`, the store's
/// `INSERT` into its bookkeeping table, with the version, the description and the checksum, then
/// any `$extra` parameters (the time, for a store whose SQL has no clock). The caller depends on
/// `sqlx`.
#[macro_export]
macro_rules! record_migration {
    ($conn:expr, $insert:expr, $m:ident, $map_err:path $(, $extra:expr)* $(,)?) => {
        ::sqlx::query(::sqlx::AssertSqlSafe($insert))
            .bind($crate::migration::Versioned::entry($m).version)
            .bind($crate::migration::Versioned::entry($m).description)
            .bind($crate::migration::Versioned::checksum($m))
            $(.bind($extra))*
            .execute($conn)
            .await
            .map_err($map_err)
    };
}

/// Apply the migration `$m` through `$conn` in one go: run `$ddl`, its SQL as rendered for the
/// store's table, as one script, then record it with [`record_migration!`] (`$insert` and any
/// `$extra` parameters as there). For a store whose DDL is transactional (PostgreSQL, SQLite);
/// MySQL sends its statements one at a time and checks the table before it records.
#[macro_export]
macro_rules! apply_migration {
    ($conn:expr, $ddl:expr, $insert:expr, $m:ident, $map_err:path $(, $extra:expr)* $(,)?) => {
        match ::sqlx::raw_sql(::sqlx::AssertSqlSafe($ddl))
            .execute(&mut *$conn)
            .await
            .map_err($map_err)
        {
            Ok(_) => $crate::record_migration!(&mut *$conn, $insert, $m, $map_err $(, $extra)*),
            Err(error) => Err(error),
        }
    };
}

/// The [`MigrationReport`] of a store's `migrate` call that applied `$applied` (a `Vec<i64>`,
/// oldest first) of the migrations `$known`, logged at info level with the fields `$fields`
/// (`table = …`, in `tracing`'s syntax) when it applied any. A macro because the log goes
/// through `tracing`, which the caller depends on (this crate does not log).
#[macro_export]
macro_rules! migration_report {
    ($applied:expr, $known:expr, $($fields:tt)+) => {{
        let applied: Vec<i64> = $applied;
        if !applied.is_empty() {
            ::tracing::info!($($fields)+, ?applied, "Outbox migrations applied.");
        }
        $crate::migration::MigrationReport {
            applied,
            current: $crate::migration::latest_version($known),
        }
    }};
}

/// The test, in a store's migrations module, that its released migrations keep their text:
/// each list of migrations, with the `(version, checksum)` of every released entry, goes
/// through [`check_released`]. A database that applied a migration checks its checksum on every
/// migrate, and a changed text (a comment is enough) would stop every existing outbox from
/// upgrading; new behaviour goes into a new migration. Written once so every store pins its
/// migrations the same way.
///
/// ```text
/// outbox_types::released_migrations_test! {
///     MIGRATIONS => [(1, "cd8d1fbc5520703d"), (2, "257f4451e150a7e6")],
/// }
/// ```
#[macro_export]
macro_rules! released_migrations_test {
    ($($list:expr => [$(($version:expr, $checksum:expr)),* $(,)?]),+ $(,)?) => {
        /// A released migration's text never changes (see
        /// `outbox_types::released_migrations_test!`).
        #[test]
        fn released_migrations_keep_their_checksums() {
            $(
                assert_eq!(
                    $crate::migration::check_released($list, &[$(($version, $checksum)),*]),
                    Ok(())
                );
            )+
        }
    };
}

/// What a `migrate` call did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this call, oldest first (empty when the schema was current).
    pub applied: Vec<i64>,
    /// The schema version now in the database.
    pub current: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN: &[Migration] = &[
        Migration {
            version: 1,
            description: "one",
            sql: "SELECT 1",
        },
        Migration {
            version: 2,
            description: "two",
            sql: "SELECT 2",
        },
    ];

    #[test]
    fn nothing_applied_means_everything_pending() {
        let todo = pending(Schema::OUTBOX, KNOWN, &[]).unwrap();
        assert_eq!(todo.len(), 2);
        assert_eq!(latest_version(KNOWN), 2);
        assert_eq!(latest_version::<Migration>(&[]), 0);
    }

    #[test]
    fn a_newer_database_is_refused_with_the_schema_named() {
        let applied = [(3, "x".to_owned())];
        assert_eq!(
            pending(Schema::INBOX, KNOWN, &applied)
                .unwrap_err()
                .to_string(),
            "the database has inbox schema version 3, newer than this build knows (2); upgrade outbox-inbox"
        );
        let error: StoreError = pending(Schema::OUTBOX, KNOWN, &applied).unwrap_err().into();
        assert!(
            matches!(error, StoreError::NotMigrated(m) if m.contains("upgrade the outbox binary or library"))
        );
    }

    #[test]
    fn an_edited_migration_is_refused() {
        let applied = [(1, KNOWN[0].checksum()), (2, "edited".to_owned())];
        assert_eq!(
            pending(Schema::OUTBOX, KNOWN, &applied)
                .unwrap_err()
                .to_string(),
            "outbox migration 2 (two) differs from the one applied to the database; migrations must never be edited once released"
        );
    }
}
