//! A provider's `[secrets]` through the real daemon: the guest gets the value
//! in its config, and nothing the host shows holds it — the API (provider,
//! instance errors, events), the CLI, the daemon's log, the store; another
//! provider cannot name it; an inline secret is refused at add.

use crate::common::{Daemon, broker};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

const SECRET: &str = "tok-7f3a9c1e-d00d-secret";

fn private(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn manifest(dir: &Path, name: &str, extra: &str) -> String {
    let wasm = guest_artifacts::wasm("test-hostile");
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "name = \"{name}\"\ncomponent = \"{}\"\n[grants]\nkv = true\n[config]\nmode = \"leak\"\n{extra}",
        wasm.display()
    );
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn a_secret_reaches_its_guest_and_nothing_the_host_shows() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    private(&data.join("secrets/leaky/api"), &format!("{SECRET}\n"));
    let log = dir.path().join("daemon.log");
    let mut daemon = Daemon::start_logging(&data, &log);
    let leaky = manifest(dir.path(), "leaky", "[secrets]\napi-token = \"api\"\n");
    let (status, added) = daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{leaky}\"}}")));
    assert_eq!(status, 201, "{added}");

    // Every way the guest hands it back: a start's error and status, a listing's error, its output.
    let (_, started) = daemon.request("POST", "/v1/instances", Some(br#"{"provider":"leaky"}"#));
    assert!(started.contains("\"event\":\"failed\""), "{started}");
    assert!(started.contains("the cloud refused token <secret api>"), "{started}");
    assert!(started.contains("\"info\":\"using <secret api>\""), "{started}");
    let (_, listed) = daemon.request("GET", "/v1/instances?provider=leaky", None);
    let (_, shown) = daemon.request("GET", "/v1/providers/leaky", None);
    assert!(shown.contains("\"api-token\":\"<secret api>\""), "{shown}");
    let (_, events) = daemon.request("GET", "/v1/events", None);
    assert!(events.contains("\"kind\":\"added\""), "{events}");
    let cli = broker(&data, &["provider", "show", "leaky"]);
    let cli = String::from_utf8_lossy(&cli.stdout).into_owned() + &String::from_utf8_lossy(&cli.stderr);
    assert!(cli.contains("<secret api>"), "{cli}");
    for (what, text) in [("start", &started), ("list", &listed), ("show", &shown), ("events", &events), ("cli", &cli)] {
        assert!(!text.contains(SECRET), "{what} holds the secret: {text}");
    }

    // Rotated: the guest is given the new one (the old one would show), hidden as well.
    private(&data.join("secrets/leaky/api"), "tok-rotated-0000-secret\n");
    let (_, again) = daemon.request("POST", "/v1/instances", Some(br#"{"provider":"leaky"}"#));
    assert!(again.contains("<secret api>") && !again.contains("tok-rotated") && !again.contains(SECRET), "{again}");

    // An instance it reports says it too: listed, hidden.
    private(&data.join("secrets/lister/api"), &format!("{SECRET}\n"));
    let lister = manifest(dir.path(), "lister", "[secrets]\napi-token = \"api\"\n");
    std::fs::write(&lister, std::fs::read_to_string(&lister).unwrap().replace("\"leak\"", "\"leak-record\"")).unwrap();
    let (status, added) = daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{lister}\"}}")));
    assert_eq!(status, 201, "{added}");
    let (_, listed) = daemon.request("GET", "/v1/instances?provider=lister", None);
    assert!(listed.contains("reachable with <secret api>") && !listed.contains(SECRET), "{listed}");
    // Its name, address and hardware too (all shown of an instance the host did not start).
    for shown in ["named <secret api>", "<secret api>.example", "zone-<secret api>"] {
        assert!(listed.contains(shown), "{shown}: {listed}");
    }

    // Another provider cannot name it: its secrets are in a dir of its own.
    let other = manifest(dir.path(), "other", "[secrets]\napi-token = \"api\"\n");
    let (status, refused) =
        daemon.request("POST", "/v1/providers", Some(format!("{{\"manifest\":\"{other}\"}}").as_bytes()));
    assert!(status >= 400 && refused.contains("secrets/other/api") && refused.contains("no such file"), "{refused}");
    // A secret given inline is refused, and the refusal does not quote it.
    let inline = manifest(dir.path(), "inline", &format!("password = \"{SECRET}-inline\"\n"));
    let (status, refused) =
        daemon.request("POST", "/v1/providers", Some(format!("{{\"manifest\":\"{inline}\"}}").as_bytes()));
    assert!(status >= 400 && refused.contains("looks like a secret given inline"), "{refused}");
    assert!(!refused.contains(SECRET), "{refused}");

    assert!(daemon.terminate().success());
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("stdout: my token is <secret api>"), "the guest's output is logged, hidden: {log}");
    assert!(!log.contains(SECRET) && !log.contains("tok-rotated"), "the log holds the secret");
    let state = std::fs::read(data.join("state.redb")).unwrap();
    assert!(!state.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()), "the store holds the secret");
}

/// `provider test --record` hands a component the real secrets only when told
/// to (`--with-secrets`: the manifest's own name picks them); either way the
/// report holds the stand-in.
#[test]
fn a_recording_gives_real_secrets_only_with_with_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let leaky = manifest(dir.path(), "leaky", "[secrets]\napi-token = \"api\"\n");
    let wasm = guest_artifacts::wasm("test-hostile");
    let script = dir.path().join("leaky.script.json");
    let test = |with_secrets: bool| {
        let mut args = vec!["provider", "test", wasm.to_str().unwrap(), "--manifest", &leaky];
        args.extend(["--record", script.to_str().unwrap()]);
        if with_secrets {
            args.push("--with-secrets");
        }
        let out = broker(&data, &args);
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // No secret on this host: stand-ins serve, and the real ones are not even looked for.
    let (report, said) = test(false);
    assert!(report.contains("the cloud refused token kit-secret:api"), "{report}\n{said}");
    assert!(said.contains("stand-ins") && said.contains("--with-secrets"), "{said}");
    let (_, said) = test(true);
    assert!(said.contains("secrets/leaky/api") && said.contains("no such file"), "{said}");
    private(&data.join("secrets/leaky/api"), SECRET);
    let (report, said) = test(true);
    assert!(report.contains("the cloud refused token kit-secret:api"), "{report}\n{said}");
    assert!(said.contains("--with-secrets gives this component the secrets api"), "{said}");
    let recorded = std::fs::read_to_string(&script).unwrap();
    for text in [&report, &said, &recorded] {
        assert!(!text.contains(SECRET), "{text}");
    }
}

/// A provider whose next-page cursor holds its secret's value: the host
/// never hands that cursor out (it cuts the provider's pages from its whole
/// listing instead), and the pages still list all it lists.
#[test]
fn a_cursor_holding_a_secret_is_never_handed_out() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    private(&data.join("secrets/pager/api"), &format!("{SECRET}\n"));
    let daemon = crate::common::Daemon::start(&data);
    let pager = manifest(dir.path(), "pager", "[secrets]\napi-token = \"api\"\n");
    std::fs::write(&pager, std::fs::read_to_string(&pager).unwrap().replace("\"leak\"", "\"leak-cursor\"")).unwrap();
    let (status, added) = daemon.json("POST", "/v1/providers", Some(&format!("{{\"manifest\":\"{pager}\"}}")));
    assert_eq!(status, 201, "{added}");
    let (mut ids, mut after, mut cursors) = (Vec::new(), String::new(), Vec::new());
    for _ in 0..4 {
        let path = format!("/v1/instances?limit=1{after}");
        let (status, body, next) = crate::common::list_page(&daemon.socket, &path);
        assert_eq!(status, 200, "{body}");
        assert!(!body.contains(SECRET), "{body}");
        let page: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        ids.extend(page.iter().map(|r| r["id"].as_str().unwrap().to_owned()));
        let Some(next) = next else { break };
        // What the cursor holds: its fields, as JSON, before its seal.
        let fields = next.strip_prefix("~1.").and_then(|sealed| sealed.split_once('.')).unwrap().0;
        let fields = data_encoding::BASE64URL_NOPAD.decode(fields.as_bytes()).unwrap();
        cursors.push(String::from_utf8(fields).unwrap());
        after = format!("&after={next}");
    }
    assert_eq!(ids, ["i-1", "i-2"]);
    assert!(!cursors.is_empty());
    for cursor in &cursors {
        assert!(!cursor.contains(SECRET) && !cursor.contains("after-"), "{cursor}");
    }
}
