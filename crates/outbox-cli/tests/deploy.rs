//! The deployment files (`Dockerfile`, `deploy/kubernetes/relay.yaml`) configure the relay by
//! environment variables alone: every `OUTBOX_*` variable they set must be one the relay reads,
//! with a value it accepts. There is no container engine here to run the image; this loads the
//! same environment into `outbox config check`, which fails on an unknown key or a bad value.

mod common;

use std::process::Command;

use common::BIN;

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// `OUTBOX_*` variables the manifest sets: `value:` as written, `valueFrom:` (a secret, the pod's
/// name) as a stand-in.
fn manifest_env(yaml: &str) -> Vec<(String, String)> {
    let mut vars = Vec::new();
    let mut lines = yaml.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(name) = line.trim().strip_prefix("- name: ") else {
            continue;
        };
        if !name.starts_with("OUTBOX_") {
            continue;
        }
        let next = lines.peek().map(|l| l.trim()).unwrap_or("");
        let value = if let Some(value) = next.strip_prefix("value: ") {
            value.trim_matches('"').to_owned()
        } else if next.starts_with("valueFrom:") && name == "OUTBOX_DATABASE__URL" {
            "sqlite::memory:".to_owned()
        } else if next.starts_with("valueFrom:") {
            "pod-1".to_owned()
        } else {
            panic!("{name} has neither value nor valueFrom: {next}");
        };
        vars.push((name.to_owned(), value));
    }
    vars
}

/// `OUTBOX_*` variables the Dockerfile's `ENV` sets (`KEY=value`, continued lines included;
/// comments skipped).
fn dockerfile_env(dockerfile: &str) -> Vec<(String, String)> {
    dockerfile
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .flat_map(str::split_whitespace)
        .filter_map(|word| word.split_once('='))
        .filter(|(k, _)| k.starts_with("OUTBOX_"))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[test]
fn the_deployment_environment_is_a_valid_relay_configuration() {
    let mut vars = dockerfile_env(&repo_file("Dockerfile"));
    assert_eq!(vars.len(), 2, "{vars:?}");
    let manifest = manifest_env(&repo_file("deploy/kubernetes/relay.yaml"));
    assert!(manifest.len() >= 5, "{manifest:?}");
    vars.extend(manifest);
    let out = Command::new(BIN)
        .args(["config", "check", "--json"])
        .env_clear()
        .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    common::assert_succeeded(&out, &format!("{vars:?}"));
    let config: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(config["metrics"]["listen"], "0.0.0.0:9464");
    assert_eq!(config["relay"]["relay_id"], "pod-1");
    assert_eq!(config["destinations"]["events"]["type"], "kafka");
    assert_eq!(
        config["destinations"]["events"]["topic"],
        "events.${event_type}"
    );
}

/// The value of the first line of `yaml` that reads `key: value` (trimmed, any indentation).
fn yaml_value<'a>(yaml: &'a str, key: &str) -> Option<&'a str> {
    yaml.lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .find_map(|line| line.trim().strip_prefix(&format!("{key}: ")))
        .map(str::trim)
}

/// The pod runs without what it does not need: no service account token (the relay never calls
/// the Kubernetes API), the runtime's default seccomp filter, no privilege escalation, no
/// capability, a read-only root; and it runs a pinned image, the one of this version, never
/// `latest` (a release that bumps the workspace version fails here until the tag follows).
#[test]
fn the_manifest_runs_a_pinned_image_without_a_token_and_under_seccomp() {
    let yaml = repo_file("deploy/kubernetes/relay.yaml");
    assert_eq!(
        yaml_value(&yaml, "automountServiceAccountToken"),
        Some("false")
    );
    assert_eq!(
        yaml_value(&yaml, "seccompProfile"),
        Some("{ type: RuntimeDefault }")
    );
    assert_eq!(yaml_value(&yaml, "runAsNonRoot"), Some("true"));
    assert_eq!(yaml_value(&yaml, "allowPrivilegeEscalation"), Some("false"));
    assert_eq!(yaml_value(&yaml, "readOnlyRootFilesystem"), Some("true"));
    assert_eq!(
        yaml_value(&yaml, "capabilities"),
        Some(r#"{ drop: ["ALL"] }"#)
    );
    let version = env!("CARGO_PKG_VERSION");
    let images: Vec<&str> = yaml
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .filter_map(|line| line.trim().strip_prefix("image: "))
        .collect();
    assert_eq!(
        images,
        [format!("outbox:{version}")],
        "one relay image, pinned"
    );
    assert!(
        repo_file("Dockerfile").contains(&format!("docker build -t outbox:{version} .")),
        "the Dockerfile's build line tags the same version"
    );
    // The metrics port listens on every interface (for the probes); a NetworkPolicy admits only
    // the scraper's namespace to it (the node's probes always pass).
    let policy = &yaml[yaml.find("kind: NetworkPolicy").expect("a NetworkPolicy")..];
    assert_eq!(yaml_value(policy, "policyTypes"), Some("[Ingress]"));
    assert!(
        policy.contains("- { port: metrics, protocol: TCP }"),
        "{policy}"
    );
}
