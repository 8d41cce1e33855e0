//! Secrets that live in a webhook URL's path and in query keys no old rule knew (`accessToken`,
//! `clientSecret`, `apiToken`, `sig`), and a receiver that quotes the URL back in its error
//! page: none of them may reach `config check`, the relay's log, `last_error`, `dead list`,
//! `dead show` or `status` (SECURITY.md, "One redactor").

use std::process::Command;

use axum::Router;
use axum::http::{StatusCode, Uri};
use sqlx::AssertSqlSafe;

use super::{Outputs, common};

/// A generated token in the path (a base62 run: rule 3 of the redactor's "Secrets in paths").
const PATH_TOKEN: &str = "Tk7qP2xW9mB4vN8cL3sR6yH1";
/// Values of credential-named query keys, in the spellings receivers use.
const ACCESS: &str = "accesstokenvalue-harden";
const CLIENT: &str = "clientsecretvalue-harden";
const API: &str = "apitokenvalue-harden";
const SIG: &str = "sigvalue-harden";
/// The Slack-style secret a writer's row points at (letters only: the known shape masks it).
const SLACK: &str = "slackpathsecretvalueharden";
/// The configured Slack destination's secret (never contacted).
const SLACK_CONFIGURED: &str = "configuredslacksecretharden";
const SECRETS: [&str; 7] = [
    PATH_TOKEN,
    ACCESS,
    CLIENT,
    API,
    SIG,
    SLACK,
    SLACK_CONFIGURED,
];

/// Answers 200 for aggregate `ok`; 400 quoting the request's path and query (no scheme) for
/// `bad`; 500 quoting the full URL for `err`.
async fn quoting(uri: Uri) -> (StatusCode, String) {
    let target = uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    if target.contains("/bad?") {
        (StatusCode::BAD_REQUEST, format!("Cannot POST {target}"))
    } else if target.contains("/err?") {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("failed on http://127.0.0.1{target}"),
        )
    } else {
        (StatusCode::OK, "ok".to_owned())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_tokens_and_camel_case_query_secrets_are_never_printed() {
    let port = common::serve(Router::new().fallback(quoting)).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let config = common::write_config(
        dir.path(),
        &format!(
            r#"
[database]
url = "sqlite://{db}?mode=rwc"

[relay]
poll_interval = "20ms"

[relay.retry]
base = "10ms"
cap = "20ms"
max_attempts = 2

[destinations.hooks]
type = "webhook"
url = "http://127.0.0.1:{port}/hooks/{PATH_TOKEN}/${{aggregate_id}}?accessToken={ACCESS}&clientSecret={CLIENT}&apiToken={API}&sig={SIG}&region=eu"

[destinations.slack]
type = "webhook"
url = "https://hooks.slack.com/services/T0HARDEN/B0HARDEN/{SLACK_CONFIGURED}"

[[routes]]
when = {{ event_type = "Slack*" }}
to = "slack"

[[routes]]
to = "hooks"
"#,
            db = db.display(),
        ),
    );
    let config_arg = config.to_str().unwrap();
    let mut outputs = Outputs::default();
    outputs.succeeds("migrate", &["migrate", "--config", config_arg]);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    // (aggregate, destination column)
    let slack_row = format!("https://hooks.slack.com/services/T1/B2/{SLACK}");
    let rows = [
        ("ok", None),
        ("bad", None),
        ("err", None),
        ("steal", Some(slack_row)),
    ];
    for (n, (aggregate, destination)) in rows.iter().enumerate() {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, headers,
                                        destination, occurred_at, enqueued_at, next_attempt_at)
             VALUES ('0193a0c0-0000-7000-8000-00000000001{n}', 'acct', ?, 'Hostile', '{{}}', '{{}}', ?,
                     unixepoch() * 1000000, unixepoch() * 1000000, unixepoch() * 1000000)"
        )))
        .bind(aggregate)
        .bind(destination)
        .execute(&pool)
        .await
        .unwrap();
    }
    outputs.succeeds(
        "relay --drain",
        &["relay", "--config", config_arg, "--drain"],
    );

    let dead: Vec<(String, String)> = sqlx::query_as(
        "SELECT aggregate_id, last_error FROM outbox_events WHERE status = 'dead' ORDER BY aggregate_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let aggregates: Vec<&str> = dead.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(aggregates, ["bad", "err", "steal"], "{dead:?}");
    for (aggregate, error) in &dead {
        for secret in SECRETS {
            assert!(!error.contains(secret), "{aggregate}: {error}");
        }
    }
    // Masked, not dropped: the reasons still show where the request went.
    let reason = |a: &str| dead.iter().find(|(x, _)| x == a).unwrap().1.clone();
    common::assert_contains(&reason("bad"), "Cannot POST /hooks/***/bad?accessToken=***");
    common::assert_contains(
        &reason("err"),
        "clientSecret=***&apiToken=***&sig=***&region=eu",
    );
    common::assert_contains(&reason("steal"), "host `hooks.slack.com`");

    for (what, args) in [
        (
            "config check",
            vec!["config", "check", "--config", config_arg],
        ),
        (
            "config check --json",
            vec!["config", "check", "--config", config_arg, "--json"],
        ),
        ("status", vec!["status", "--config", config_arg]),
        (
            "status --json",
            vec!["status", "--config", config_arg, "--json"],
        ),
        ("dead list", vec!["dead", "list", "--config", config_arg]),
        (
            "dead list --json",
            vec!["dead", "list", "--config", config_arg, "--json"],
        ),
    ] {
        outputs.succeeds(what, &args);
    }
    for n in 1..4 {
        let id = format!("0193a0c0-0000-7000-8000-00000000001{n}");
        outputs.succeeds(
            &format!("dead show {n}"),
            &["dead", "show", &id, "--config", config_arg],
        );
    }
    let check = Command::new(common::BIN)
        .args(["config", "check", "--config", config_arg])
        .output()
        .unwrap();
    common::assert_contains(
        &common::text(&check),
        "https://hooks.slack.com/services/T0HARDEN/B0HARDEN/***",
    );
    // `dead show` prints the row's destination column with its path token masked.
    let shown = outputs.0.iter().find(|(w, _)| w == "dead show 3").unwrap();
    common::assert_contains(&shown.1, "https://hooks.slack.com/services/T1/B2/***");
    outputs.check_for(&SECRETS);
}
