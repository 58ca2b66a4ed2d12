//! A real Incus daemon for the LXD provider's tests: started by the test in a
//! mount and network namespace of its own (scripts/incus-netns.sh), with its
//! state in a temporary directory, initialised minimally (a `dir` storage
//! pool, a root disk in the default profile, the busybox image from
//! scripts/incus-image.sh under the alias `busybox`), and stopped by its pid
//! when the test drops it.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub struct IncusDaemon {
    dir: tempfile::TempDir,
    child: Child,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$BROKER_INCUS_IMAGE`, or `target/incus-image/busybox.tar.gz` of this workspace.
pub fn busybox_image() -> PathBuf {
    let path = std::env::var_os("BROKER_INCUS_IMAGE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/incus-image/busybox.tar.gz"));
    assert!(
        path.exists(),
        "no container image at {}: run scripts/incus-image.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

impl IncusDaemon {
    /// Start incusd with an unmanaged bridge `bridge` in its namespace; ready to launch `busybox`.
    pub fn start(bridge: &str) -> IncusDaemon {
        let dir = tempfile::Builder::new().prefix("broker-incus-").tempdir().expect("tempdir");
        let var = dir.path().join("var");
        std::fs::create_dir(&var).expect("INCUS_DIR");
        let log = std::fs::File::create(dir.path().join("incusd.log")).expect("log file");
        let child = Command::new("unshare")
            .args(["--mount", "--net", "sh"])
            .arg(repo_root().join("scripts/incus-netns.sh"))
            .arg(bridge)
            .env("INCUS_DIR", &var)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("cannot run unshare to start incusd (is util-linux installed?)");
        let daemon = IncusDaemon { dir, child };
        let ready = daemon.incus(&["admin", "waitready", "--timeout", "60"]);
        assert!(ready.status.success(), "incusd did not become ready: {}", daemon.log());
        daemon.incus_ok(&["storage", "create", "default", "dir"]);
        daemon.incus_ok(&["profile", "device", "add", "default", "root", "disk", "path=/", "pool=default"]);
        let image = busybox_image();
        daemon.incus_ok(&["image", "import", &image.display().to_string(), "--alias", "busybox"]);
        daemon
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's API socket, for the provider's `[grants.http]`.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("var/unix.socket")
    }

    /// The daemon's network namespace (where the bridge and the containers' host ends live).
    pub fn netns(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.pid()))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("incusd.log")).unwrap_or_default()
    }

    /// Run the `incus` client against this daemon.
    pub fn incus(&self, args: &[&str]) -> Output {
        Command::new("incus")
            .args(args)
            .env("INCUS_DIR", self.dir.path().join("var"))
            .stdin(Stdio::null())
            .output()
            .expect("cannot run the incus client")
    }

    /// As [`incus`](Self::incus), asserting success; returns stdout.
    pub fn incus_ok(&self, args: &[&str]) -> String {
        let out = self.incus(args);
        assert!(
            out.status.success(),
            "incus {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `GET` on the REST API (through `incus query`); `None` on an error such as 404.
    pub fn api(&self, path: &str) -> Option<serde_json::Value> {
        let out = self.incus(&["query", path]);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).expect("incus query prints JSON"))
    }

    /// Names of all instances the daemon has, in every project; `None` if it cannot say.
    pub fn instance_names(&self) -> Option<Vec<String>> {
        let out = self.incus(&["list", "--all-projects", "--format", "csv", "--columns", "n"]);
        let names = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).filter(|l| !l.is_empty()).collect();
        out.status.success().then_some(names)
    }
}

impl Drop for IncusDaemon {
    fn drop(&mut self) {
        // Containers outlive incusd; remove them through it first.
        for name in self.instance_names().unwrap_or_default() {
            let _ = self.incus(&["delete", "--force", &name]);
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = kill(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

const BUNDLED_GRANT: &str = "lxd = \"unix:/var/lib/incus/unix.socket\"";

/// The bundled LXD manifest with its grant pointing at `socket` (or no
/// `[grants.http]` at all), under `name` and `namespace`.
pub fn lxd_manifest_text(socket: &Path, name: &str, namespace: &str, grant: bool) -> String {
    let bundled = crate::bundled_manifest_text("lxd");
    assert!(
        bundled.contains(BUNDLED_GRANT) && bundled.contains("namespace = \"host0\""),
        "bundled lxd manifest changed"
    );
    let grant = if grant { format!("lxd = \"unix:{}\"", socket.display()) } else { String::new() };
    let text = bundled
        .replace("name = \"lxd\"", &format!("name = \"{name}\""))
        .replace(BUNDLED_GRANT, &grant)
        .replace("namespace = \"host0\"", &format!("namespace = \"{namespace}\""));
    if grant.is_empty() { text.replace("[grants.http]", "") } else { text }
}
