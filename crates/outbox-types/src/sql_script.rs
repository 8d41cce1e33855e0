//! Splitting a MySQL migration script into the statements a driver sends one at a time.
//!
//! Why here: the outbox's and the inbox's MySQL migrations both create stored procedures, whose
//! bodies hold `;`. The scripts are written as the `mysql` client reads them (a `DELIMITER` line
//! before and after a routine), so `outbox schema print` hands a DBA a script their client and
//! migration tools apply as is; the migration runners send the same text one statement at a
//! time through this splitter.

/// The statements of `sql`, in order: comment lines dropped; a statement ends at the delimiter,
/// `;` unless a `DELIMITER` line (as in the mysql client) set another one.
///
/// ```
/// let sql = "-- a comment; with a semicolon\nCREATE TABLE a (x INT);\n\
///            DROP PROCEDURE IF EXISTS p;\nDELIMITER //\n\
///            CREATE PROCEDURE p() BEGIN SELECT 1; SELECT 2; END //\nDELIMITER ;\nSELECT 3;\n";
/// assert_eq!(
///     outbox_types::sql_script::statements(sql),
///     [
///         "CREATE TABLE a (x INT)",
///         "DROP PROCEDURE IF EXISTS p",
///         "CREATE PROCEDURE p() BEGIN SELECT 1; SELECT 2; END",
///         "SELECT 3",
///     ]
/// );
/// ```
///
/// Only whole comment lines are dropped: a `;` in a comment after code on the same line would
/// end the statement there, so migrations keep their comments on lines of their own.
pub fn statements(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut delimiter = ";".to_owned();
    let mut current = String::new();
    for line in sql.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("--") {
            continue;
        }
        if let Some(d) = trimmed.strip_prefix("DELIMITER ") {
            delimiter = d.trim().to_owned();
            continue;
        }
        current.push_str(line);
        current.push('\n');
        while let Some(at) = current.find(delimiter.as_str()) {
            let statement = current[..at].trim();
            if !statement.is_empty() {
                out.push(statement.to_owned());
            }
            current = current[at + delimiter.len()..].to_owned();
        }
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_owned());
    }
    out
}
