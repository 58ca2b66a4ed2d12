//! Durable starts through the daemon's API, as many clients at once as asked,
//! each on one kept-alive connection to the unix socket: what a fleet of
//! clients costs the daemon (issue 40), measured with a client that does not
//! eat the machine itself.
//!
//! ```text
//! broker-load --broker target/release/broker [--clients 16] [--starts 50000]
//! broker-load --socket DATA_DIR/broker.sock --daemon-pid PID --provider NAME [--clients 16] [--starts 50000]
//! ```
//!
//! With `--broker`, a daemon of that binary is started on a data dir of its
//! own with the bundled fake (`max-records` raised to take the starts), and
//! stopped after. Prints the starts per second, each start's latency (p50,
//! p99), and the CPU the daemon and this client spent per start. `--perf`
//! records the daemon with `perf record` meanwhile (for `perf report`).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: broker-load (--broker BIN | --socket SOCKET --daemon-pid PID --provider NAME) [--clients N] [--starts N] [--perf FILE] [--list]

Durable starts through the daemon's API, N clients at once on kept-alive
connections to its unix socket; prints starts/s, latency and CPU per start.

  --broker BIN      start a daemon of BIN on a data dir of its own, with the
                    bundled fake (stopped after)
  --socket SOCKET   a daemon already running (with --provider)
  --daemon-pid PID  with --socket: the daemon's pid, whose CPU is counted
  --provider NAME   the provider to start instances of (default fake)
  --clients N       clients at once (default 16)
  --starts N        starts in all (default 20000)
  --perf FILE       record the daemon with `perf record -g` into FILE meanwhile
  --list            then time the listing: a page of 100 (the first, 20
                    times) and the whole listing streamed (3 times)";

struct Args {
    broker: Option<PathBuf>,
    socket: Option<PathBuf>,
    provider: String,
    clients: usize,
    starts: usize,
    perf: Option<PathBuf>,
    daemon_pid: Option<i32>,
    list: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        broker: None,
        socket: None,
        provider: "fake".into(),
        clients: 16,
        starts: 20_000,
        perf: None,
        daemon_pid: None,
        list: false,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--list" {
            args.list = true;
            continue;
        }
        let value = given.next().ok_or_else(|| format!("{flag} takes a value"))?;
        let number =
            |value: &str| value.parse::<usize>().ok().filter(|n| *n > 0).ok_or(format!("{flag}: a number above 0"));
        match flag.as_str() {
            "--broker" => args.broker = Some(value.into()),
            "--socket" => args.socket = Some(value.into()),
            "--provider" => args.provider = value,
            "--clients" => args.clients = number(&value)?,
            "--starts" => args.starts = number(&value)?,
            "--perf" => args.perf = Some(value.into()),
            "--daemon-pid" => args.daemon_pid = Some(number(&value)? as i32),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.broker.is_some() == args.socket.is_some() {
        return Err("give one of --broker and --socket".into());
    }
    Ok(args)
}

/// A daemon this run started, stopped when dropped.
struct Daemon {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

/// Start `broker serve` on a new data dir and add the fake; its socket.
fn spawn_daemon(broker: &Path, starts: usize) -> Result<(Daemon, PathBuf), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let child = Command::new(broker)
        .arg("--data-dir")
        .arg(&data)
        .arg("serve")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", broker.display()))?;
    let daemon = Daemon { child, _dir: dir };
    let socket = data.join("broker.sock");
    let since = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if since.elapsed() > Duration::from_secs(30) {
            return Err(format!("the daemon never listened on {}", socket.display()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let manifest = daemon._dir.path().join("fake.toml");
    let limits = format!("[limits]\nmax-records = {}\nkv-keys = {}\nkv-mib = 1024\n", starts + 1000, starts * 2 + 1000);
    std::fs::write(&manifest, broker_tests::bundled_manifest_text("fake").replace("[limits]\n", &limits))
        .map_err(|e| e.to_string())?;
    let added = Command::new(broker)
        .arg("--data-dir")
        .arg(&data)
        .args(["provider", "add"])
        .arg(&manifest)
        .output()
        .map_err(|e| e.to_string())?;
    if !added.status.success() {
        return Err(format!("provider add: {}", String::from_utf8_lossy(&added.stderr)));
    }
    Ok((daemon, socket))
}

/// CPU time `pid` has spent, user and system, from `/proc/PID/stat`.
fn cpu_of(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) in its parentheses.
    let rest = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    let fields: Vec<u64> = rest.split_whitespace().skip(11).take(2).filter_map(|f| f.parse().ok()).collect();
    // In USER_HZ, which Linux keeps at 100 whatever the kernel's tick.
    let ticks: u64 = fields.iter().sum();
    Duration::from_millis(ticks * 10)
}

/// This process's CPU time, user and system.
fn own_cpu() -> Duration {
    let Ok(usage) = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF) else {
        return Duration::ZERO;
    };
    let time = |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
    time(usage.user_time()) + time(usage.system_time())
}

/// A kept-alive HTTP/1.1 connection to the daemon's socket.
async fn connect(socket: &Path) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| e.to_string())?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    // The connection drives the socket until the sender is dropped.
    tokio::spawn(connection);
    Ok(sender)
}

/// One client: `count` starts one after another on one connection; each
/// start's latency.
async fn client(socket: PathBuf, provider: String, count: usize) -> Result<Vec<Duration>, String> {
    let mut sender = connect(&socket).await?;
    let body = Bytes::from(format!("{{\"provider\":\"{provider}\"}}"));
    let mut latencies = Vec::with_capacity(count);
    for _ in 0..count {
        let request = http::Request::post("/v1/instances")
            .header(http::header::HOST, "broker")
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
            .map_err(|e| e.to_string())?;
        let since = Instant::now();
        sender.ready().await.map_err(|e| e.to_string())?;
        let answer = sender.send_request(request).await.map_err(|e| e.to_string())?;
        let status = answer.status();
        let lines = answer.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        latencies.push(since.elapsed());
        // The last line says how the start ended.
        let last = lines.split(|b| *b == b'\n').rfind(|line| !line.is_empty()).unwrap_or_default();
        if !status.is_success() || !last.starts_with(b"{\"event\":\"started\"") {
            return Err(format!("a start failed ({status}): {}", String::from_utf8_lossy(last)));
        }
    }
    Ok(latencies)
}

/// GET `path` on a new connection; the body and how long it took.
async fn get(socket: &Path, path: &str) -> Result<(Bytes, Duration), String> {
    let mut sender = connect(socket).await?;
    let request = http::Request::get(path)
        .header(http::header::HOST, "broker")
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let since = Instant::now();
    let answer = sender.send_request(request).await.map_err(|e| e.to_string())?;
    if !answer.status().is_success() {
        return Err(format!("GET {path}: {}", answer.status()));
    }
    let body = answer.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((body, since.elapsed()))
}

/// The listing's times: a page of 100, and the whole listing streamed.
async fn time_listing(socket: &Path, pid: i32, starts: usize) -> Result<(), String> {
    let mut pages = Vec::new();
    for _ in 0..20 {
        pages.push(get(socket, "/v1/instances?limit=100").await?.1);
    }
    pages.sort();
    let mut whole = Vec::new();
    for _ in 0..3 {
        let (body, took) = get(socket, "/v1/instances").await?;
        let listed = body.windows(6).filter(|w| w == b"\"id\":\"").count();
        if listed < starts {
            return Err(format!("the whole listing held {listed} instances, fewer than the {starts} started"));
        }
        whole.push(took);
    }
    whole.sort();
    println!(
        "listing: a page of 100 p50 {:.2?}; the whole listing streamed (median of 3) {:.2?}, {:.2} µs per instance; daemon RSS after {} KiB",
        pages[pages.len() / 2],
        whole[1],
        whole[1].as_secs_f64() * 1e6 / starts as f64,
        broker_tests::rss_kib(pid),
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(why) => {
            eprintln!("broker-load: {why}\n\n{USAGE}");
            return std::process::ExitCode::from(2);
        }
    };
    // Returned, not exited from: a daemon this run started is stopped on the way out.
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("broker-load: {why}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let (daemon, socket) = match (&args.broker, &args.socket) {
        (Some(broker), _) => {
            let (daemon, socket) = spawn_daemon(broker, args.starts)?;
            (Some(daemon), socket)
        }
        (None, Some(socket)) => (None, socket.clone()),
        (None, None) => return Err("give one of --broker and --socket".into()),
    };
    let pid = (daemon.as_ref().map(|daemon| daemon.child.id() as i32).or(args.daemon_pid))
        .ok_or("with --socket, --daemon-pid names the daemon whose CPU to count")?;
    let perf = match &args.perf {
        Some(file) => Some(
            Command::new("perf")
                .args(["record", "-g", "-F", "999", "-o"])
                .arg(file)
                .args(["-p", &pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot run perf record: {e}"))?,
        ),
        None => None,
    };
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| format!("a runtime: {e}"))?;
    let rss_before = broker_tests::rss_kib(pid);
    let (daemon_before, own_before, since) = (cpu_of(pid), own_cpu(), Instant::now());
    let answers = runtime.block_on(async {
        let clients = (0..args.clients).map(|at| {
            let count = args.starts / args.clients + usize::from(at < args.starts % args.clients);
            tokio::spawn(client(socket.clone(), args.provider.clone(), count))
        });
        futures_util::future::join_all(clients.collect::<Vec<_>>()).await
    });
    let elapsed = since.elapsed();
    let (daemon_cpu, own) = (cpu_of(pid).saturating_sub(daemon_before), own_cpu().saturating_sub(own_before));
    let rss_after = broker_tests::rss_kib(pid);
    if let Some(mut perf) = perf {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(perf.id() as i32), nix::sys::signal::Signal::SIGINT);
        let _ = perf.wait();
    }
    let mut latencies = Vec::new();
    for answer in answers {
        match answer {
            Ok(Ok(client)) => latencies.extend(client),
            Ok(Err(why)) => return Err(why),
            Err(panicked) => return Err(format!("a client panicked: {panicked}")),
        }
    }
    if args.list {
        runtime.block_on(time_listing(&socket, pid, latencies.len()))?;
    }
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    let starts = latencies.len() as f64;
    println!(
        "{} durable starts, {} clients: {:.0}/s; latency p50 {:.2?}, p99 {:.2?}; CPU per start: daemon {:.1} µs, client {:.1} µs; daemon RSS {} -> {} KiB ({} B per start)",
        latencies.len(),
        args.clients,
        starts / elapsed.as_secs_f64(),
        at(0.5),
        at(0.99),
        daemon_cpu.as_secs_f64() * 1e6 / starts,
        own.as_secs_f64() * 1e6 / starts,
        rss_before,
        rss_after,
        rss_after.saturating_sub(rss_before) * 1024 / latencies.len() as u64,
    );
    Ok(())
}
