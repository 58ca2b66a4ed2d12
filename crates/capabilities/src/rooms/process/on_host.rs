//! The host's process backend: granted programs run confined (bubblewrap, the
//! provider's own user), with a session and process group each, output capped
//! and a timeout that kills the whole group; children are recorded in the
//! store so they outlive the host and are found again after a restart.

use super::backend::{Launch, ProcessBackend};
use super::children::{ChildRecord, ChildRecords, LiveChildren, Liveness, RecordsError, proc_stat};
use super::policy::PolicyError;
use crate::bindings::BrokerError;
use crate::bindings::broker::provider::process::Output;
use futures_util::future::BoxFuture;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// Each of stdout and stderr of `run` is cut at this size.
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// How often `wait` looks at a child that is not ours to wait on.
const WAIT_POLL: Duration = Duration::from_millis(10);

/// Real programs and children, recorded in `records`.
pub struct HostProcesses {
    records: Arc<dyn ChildRecords>,
    live: Arc<LiveChildren>,
}

impl HostProcesses {
    /// `records` keep children across restarts; `live` holds the handles of
    /// those this process spawned.
    pub fn new(records: Arc<dyn ChildRecords>, live: Arc<LiveChildren>) -> Self {
        HostProcesses { records, live }
    }
}

fn records_failed(err: RecordsError) -> BrokerError {
    BrokerError::Provider(crate::error_text::cause_text(err.cause()))
}

/// Taps to attach in the child, each at its descriptor number.
type PassedTaps = Vec<(crate::network::tap::TunRequest, i32)>;

/// qemu's `-netdev tap,…,ifname=NAME,…` with the tap passed as a descriptor
/// instead (`fd=N`, from `first_fd` on): programs live in a network namespace
/// of their own, where no host tap exists. The tap is attached in the child
/// as the provider's user, so the kernel attaches only to a tap that user
/// owns (the host made it so with `TUNSETOWNER`). Options that would have
/// qemu open or configure a device itself are refused.
pub(super) fn pass_taps(args: &[String], first_fd: i32) -> Result<(Vec<String>, PassedTaps), BrokerError> {
    let mut out = Vec::with_capacity(args.len());
    let mut taps = Vec::new();
    for (n, arg) in args.iter().enumerate() {
        let is_netdev = n > 0 && matches!(args[n - 1].as_str(), "-netdev" | "--netdev");
        let Some(options) = arg.strip_prefix("tap,").filter(|_| is_netdev) else {
            out.push(arg.clone());
            continue;
        };
        let mut kept = vec!["tap".to_owned()];
        let mut name = None;
        for option in options.split(',') {
            let (key, value) = option.split_once('=').unwrap_or((option, ""));
            match key {
                "ifname" => name = Some(value.to_owned()),
                "script" | "downscript" if value == "no" => {}
                "id" | "vhost" | "sndbuf" | "vnet_hdr" => kept.push(option.to_owned()),
                // A script, a helper, a descriptor of its choosing: a way to the host's network
                // that is not the provider's own tap, refused as any ungranted reach is.
                _ => {
                    return Err(BrokerError::AccessDenied(format!(
                        "tap option {key:?} is not passed: the host hands qemu the tap named by ifname= \
                         (its own, made through network-bridge), with id=, vhost=, sndbuf=, vnet_hdr="
                    )));
                }
            }
        }
        let name = name.ok_or_else(|| {
            BrokerError::InvalidParams("a tap netdev needs ifname= naming one of the provider's taps".into())
        })?;
        let request = crate::network::tap::attach_request(&name)
            .map_err(|e| BrokerError::InvalidParams(format!("tap {name:?}: {e}")))?;
        let at = first_fd + taps.len() as i32;
        kept.push(format!("fd={at}"));
        taps.push((request, at));
        out.push(kept.join(","));
    }
    Ok((out, taps))
}

/// What a failed spawn of a program that was passed taps says.
fn spawn_error(path: &std::path::Path, taps: usize, e: std::io::Error) -> BrokerError {
    if taps > 0 && e.raw_os_error() == Some(nix::libc::EPERM) {
        return BrokerError::AccessDenied(format!(
            "cannot start {}: a tap it names is not this provider's (taps are attached as its own user)",
            path.display()
        ));
    }
    BrokerError::Provider(format!("cannot start {}: {e}", path.display()))
}

/// Kills a process group when dropped, unless disarmed: a timed-out or
/// abandoned `run` takes its grandchildren with it.
struct GroupKiller(Option<i32>);

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
    }
}

/// Read all of `stream`, keeping at most `cap` bytes.
async fn read_capped(mut stream: impl AsyncRead + Unpin, cap: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return (kept, truncated),
            Ok(n) => {
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
                truncated |= n > room;
            }
        }
    }
}

impl HostProcesses {
    async fn run_confined(&self, launch: Launch<'_>, stdin: Vec<u8>, timeout_ms: u64) -> Result<Output, BrokerError> {
        let path = launch.path;
        let confinement = launch
            .policy
            .confinement()
            .ok_or_else(|| BrokerError::AccessDenied(PolicyError::Unconfined.to_string()))?;
        let (args, taps) = pass_taps(launch.args, confinement.next_free_fd(None))?;
        let tap_count = taps.len();
        // A session and process group of its own (set up before exec): the group killer reaches it all.
        let command =
            confinement.command_reporting(path, &args, launch.env, crate::sandbox::Lifetime::Call, None, taps);
        let mut command = tokio::process::Command::from(command);
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let mut child = command.spawn().map_err(|e| spawn_error(path, tap_count, e))?;
        let mut group = GroupKiller(child.id().map(|pid| pid as i32));
        tracing::debug!(provider = launch.provider, program = %path.display(), pid = ?child.id(), "run");

        let mut input = child.stdin.take();
        let feed = async move {
            if let Some(input) = input.as_mut() {
                let _ = input.write_all(&stdin).await;
            }
            drop(input);
        };
        let stdout = read_capped(child.stdout.take().expect("piped"), MAX_OUTPUT_BYTES);
        let stderr = read_capped(child.stderr.take().expect("piped"), MAX_OUTPUT_BYTES);
        let finish = async { tokio::join!(feed, stdout, stderr, child.wait()) };
        let outcome = if timeout_ms == 0 {
            Ok(finish.await)
        } else {
            tokio::time::timeout(Duration::from_millis(timeout_ms), finish).await
        };
        match outcome {
            Ok((_, (stdout, out_cut), (stderr, err_cut), status)) => {
                group.0 = None;
                let status =
                    status.map_err(|e| BrokerError::Provider(format!("waiting for {}: {e}", path.display())))?;
                use std::os::unix::process::ExitStatusExt;
                Ok(Output {
                    exit_code: status.code(),
                    signal: status.signal(),
                    stdout,
                    stderr,
                    truncated: out_cut || err_cut,
                    timed_out: false,
                })
            }
            Err(_elapsed) => {
                drop(group); // SIGKILL to the whole group
                Ok(Output {
                    exit_code: None,
                    signal: Some(Signal::SIGKILL as i32),
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                    truncated: false,
                    timed_out: true,
                })
            }
        }
    }

    async fn spawn_confined(&self, launch: Launch<'_>, name: &str) -> Result<ChildRecord, BrokerError> {
        let (provider, policy, path) = (launch.provider, launch.policy, launch.path);
        self.live.reap();
        if let Some(existing) = self.records.get(provider, name).map_err(records_failed)?
            && self.live.liveness(&existing) == Liveness::Running
        {
            return Err(BrokerError::InvalidParams(format!("a child named {name:?} is still running")));
        }
        // The provider may have planted links in its data dir: the log is opened beneath it, following none.
        let logs = policy.data_dir().join("logs");
        let log_path = logs.join(format!("{name}.log"));
        let log = crate::sandbox::beneath::dir(policy.data_dir(), std::path::Path::new("logs"))
            .and_then(|dir| crate::sandbox::beneath::append(&dir, &logs, &format!("{name}.log")))
            .map_err(|e| match e {
                // A link where the log goes is the provider's doing: refused, and noted as such.
                crate::sandbox::beneath::BeneathError::Escapes { .. } => {
                    BrokerError::AccessDenied(format!("cannot open the child's log: {e}"))
                }
                crate::sandbox::beneath::BeneathError::Io { .. } => {
                    BrokerError::Provider(format!("cannot open the child's log: {e}"))
                }
            })?;
        let log_err = log.try_clone().map_err(|e| BrokerError::Provider(e.to_string()))?;
        let confinement =
            policy.confinement().ok_or_else(|| BrokerError::AccessDenied(PolicyError::Unconfined.to_string()))?;
        // bubblewrap says which process holds the sandbox (its pid namespace's
        // first): the child lives as long as it does.
        let (info, info_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
            .map_err(|e| BrokerError::Provider(format!("cannot spawn {}: {e}", path.display())))?;
        use std::os::fd::AsRawFd;
        let (args, taps) = pass_taps(launch.args, confinement.next_free_fd(Some(info_write.as_raw_fd())))?;
        let tap_count = taps.len();
        let mut command = confinement.command_reporting(
            path,
            &args,
            launch.env,
            crate::sandbox::Lifetime::Detached,
            Some(info_write.as_raw_fd()),
            taps,
        );
        // A session and process group of its own: signals go to the whole group,
        // and the host's own signals (Ctrl-C) and terminal do not reach it.
        let spawned = command.stdin(Stdio::null()).stdout(log).stderr(log_err).spawn();
        drop(info_write);
        let child = spawned.map_err(|e| spawn_error(path, tap_count, e))?;
        let pid = child.id();
        let start_time = proc_stat(pid).map(|(start, _)| start).unwrap_or(0);
        let sandbox = sandbox_init(info).await;
        if sandbox.is_none() {
            tracing::warn!(provider, child = name, pid, "bubblewrap did not say which process holds the sandbox");
        }
        let record = ChildRecord {
            provider: provider.to_owned(),
            name: name.to_owned(),
            pid,
            start_time,
            program: path.display().to_string(),
            args: launch.args.to_vec(),
            log: log_path.display().to_string(),
            sandbox,
        };
        self.live.insert(provider, name, child);
        self.records.put(&record).await.map_err(records_failed)?;
        tracing::info!(provider, child = name, pid, "spawned child");
        Ok(record)
    }
}

/// Longest bubblewrap's report of what it made may be.
const MAX_INFO_BYTES: usize = 4096;

/// The pid and start time of the sandbox's first process, from bubblewrap's
/// `--info-fd` report (`{"child-pid": N, …}`), within a few seconds.
async fn sandbox_init(info: std::os::fd::OwnedFd) -> Option<(u32, u64)> {
    let mut receiver = tokio::net::unix::pipe::Receiver::from_owned_fd(info).ok()?;
    let mut text = Vec::new();
    let read = async {
        let mut buf = [0u8; 512];
        while text.len() < MAX_INFO_BYTES && !text.contains(&b'}') {
            match receiver.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => text.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read).await.ok()?;
    #[derive(serde::Deserialize)]
    struct Info {
        #[serde(rename = "child-pid")]
        child_pid: u32,
    }
    let end = text.iter().position(|&b| b == b'}')? + 1;
    let pid = serde_json::from_slice::<Info>(&text[..end]).ok()?.child_pid;
    let (start, _) = proc_stat(pid)?;
    Some((pid, start))
}

impl ProcessBackend for HostProcesses {
    fn runs_programs(&self) -> bool {
        true
    }

    fn run<'a>(
        &'a self,
        launch: Launch<'a>,
        stdin: Vec<u8>,
        timeout_ms: u64,
    ) -> BoxFuture<'a, Result<Output, BrokerError>> {
        Box::pin(self.run_confined(launch, stdin, timeout_ms))
    }

    fn spawn<'a>(&'a self, launch: Launch<'a>, name: &'a str) -> BoxFuture<'a, Result<ChildRecord, BrokerError>> {
        Box::pin(self.spawn_confined(launch, name))
    }

    fn adopt<'a>(
        &'a self,
        provider: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ChildRecord>, BrokerError>> {
        Box::pin(async move {
            let Some(record) = self.records.get(provider, name).map_err(records_failed)? else {
                return Ok(None);
            };
            if self.live.liveness(&record) == Liveness::Gone {
                // Gone for good (or its pid was recycled): forget it. The handle
                // goes first, so a call dropped while the removal commits keeps none.
                self.live.remove(provider, name);
                self.records.remove(provider, name).await.map_err(records_failed)?;
                return Ok(None);
            }
            Ok(Some(record))
        })
    }

    fn liveness(&self, record: &ChildRecord) -> Liveness {
        self.live.liveness(record)
    }

    fn wait<'a>(&'a self, record: &'a ChildRecord, timeout: Duration) -> BoxFuture<'a, Liveness> {
        Box::pin(async move {
            let until = Instant::now() + timeout;
            loop {
                let liveness = self.live.liveness(record);
                if liveness != Liveness::Running || Instant::now() >= until {
                    return liveness;
                }
                tokio::time::sleep(WAIT_POLL).await;
            }
        })
    }

    fn signal(&self, record: &ChildRecord, signal: Signal) -> Result<(), BrokerError> {
        let group = killpg(Pid::from_raw(record.pid as i32), signal);
        // A KILL takes the whole sandbox: its first process dies, and the
        // kernel kills what else lives in its pid namespace (processes that
        // left the group, `-daemonize`d ones). Other signals cannot reach
        // that process from here: pid 1 of a namespace has no default actions.
        if signal == Signal::SIGKILL
            && let Some((pid, _)) = record.sandbox.filter(|_| record.sandbox_lives())
        {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            return Ok(());
        }
        match group {
            Err(nix::errno::Errno::ESRCH) if record.sandbox_lives() => Ok(()),
            other => {
                other.map_err(|e| BrokerError::Provider(format!("signal {signal} to child {:?}: {e}", record.name)))
            }
        }
    }

    fn forget<'a>(&'a self, record: &'a ChildRecord) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.live.remove(&record.provider, &record.name);
            let _ = self.records.remove(&record.provider, &record.name).await;
        })
    }

    fn children(&self, provider: &str) -> Result<Vec<String>, RecordsError> {
        self.live.reap();
        Ok(self.records.list(provider)?.into_iter().map(|r| r.name).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn a_tap_netdev_becomes_a_passed_descriptor_and_other_ways_to_a_device_are_refused() {
        let args = strings(&["-netdev", "tap,id=net0,ifname=kt1n0,script=no,downscript=no", "-device", "tap,x"]);
        let (out, taps) = pass_taps(&args, 7).unwrap();
        assert_eq!(out, strings(&["-netdev", "tap,id=net0,fd=7", "-device", "tap,x"]), "only a -netdev value is a tap");
        assert_eq!(taps.len(), 1);
        assert_eq!(taps[0].1, 7);
        assert_eq!(format!("{:?}", taps[0].0), "TunRequest(\"kt1n0\")");
        for bad in [
            "tap,id=n,ifname=kt1,script=/data/up.sh",
            "tap,id=n,fd=3",
            "tap,id=n,ifname=kt1,helper=/usr/lib/qemu/qemu-bridge-helper",
            "tap,id=n,ifname=kt1,vhostfd=4",
            "tap,id=n",
            "tap,id=n,ifname=../../x",
            "tap,id=n,ifname=a-name-far-too-long",
        ] {
            assert!(pass_taps(&strings(&["-netdev", bad]), 7).is_err(), "{bad}");
        }
        // What reaches past the provider's own tap is a refusal the kit counts, not a bad parameter.
        let scripted = pass_taps(&strings(&["-netdev", "tap,id=n,ifname=kt1,script=/data/up"]), 7);
        assert!(matches!(scripted, Err(BrokerError::AccessDenied(_))), "{scripted:?}");
        let two = strings(&["-netdev", "tap,id=a,ifname=kt1", "-netdev", "tap,id=b,ifname=kt2,vhost=on"]);
        let (out, taps) = pass_taps(&two, 20).unwrap();
        assert_eq!(out, strings(&["-netdev", "tap,id=a,fd=20", "-netdev", "tap,id=b,vhost=on,fd=21"]));
        assert_eq!(taps.iter().map(|t| t.1).collect::<Vec<_>>(), [20, 21]);
    }
}
