//! A provider that misbehaves on demand, to test the host's containment.
//! `all-instances` reads the kv key `mode`:
//! - `count` (or absent): returns one instance whose id is the number of calls
//!   this wasm instance has served — it tells a reused instance from a fresh one;
//! - `trap`: panics (a wasm trap);
//! - `loop`: spins forever (only the deadline stops it);
//! - `write-loop`: sets kv `written` to `yes`, then `written-next` to `yes`, then
//!   spins as `loop` does;
//! - `memhog`: allocates until memory runs out;
//! - `print`: writes a line to stdout and one to stderr;
//! - `forge`: writes a line to stderr that carries a carriage return and an
//!   erase-line sequence, to pass for a line of the host's own;
//! - `lock`: takes the machine lock and releases it, returning instance `locked`;
//! - `lock-leak`: takes the machine lock and forgets the guard;
//! - `run`: runs `echo hello` through the process capability, returning its output as the id;
//! - `symlink`: makes `/data/escape`, a link out of its data dir;
//! - `exec`: runs the program and arguments in kv `exec` (NUL-separated) with the
//!   environment in `exec-env`, returning `exit-<code>` (stderr kept in kv `exec-stderr`);
//! - `spawn`: spawns kv `exec` (with `exec-env`) as a long-running child named kv
//!   `spawn-name`, returning `spawned`;
//! - `write`: writes kv `write-bytes` to `/data/` + kv `write-path` (making its
//!   directories), returning `written`;
//! - `lock-as`: takes the machine lock as worker kv `lock-worker` with comment kv
//!   `lock-comment` and releases it, returning `locked`;
//! - `drop-in`: writes a manifest granting `sh` (and a component) into its data dir;
//! - `fs`: writes `/data/hello.txt` and reads it back, returning its text as the id;
//! - `bridge:<dev>`: bridges `<dev>` into its Juju bridge and returns the visible devices, comma-separated;
//! - `bridge-to:<dev>:<br>`, `tap:<name>:<br>`, `veth:<name>:<peer>:<br>`, `attach:<dev>:<br>`,
//!   `unbridge:<dev>:<br>`, `delete-link:<name>`: that one network-bridge call, returning
//!   instance `done` (its error is the call's: a refusal reaches the host as the guest's error);
//! - `ids`: returns one instance per NUL-separated entry of kv key `ids`, verbatim
//!   (ids with escape sequences, newlines, another provider's ids);
//! - `status-flood`: calls `set-status` kv `flood-calls` times, each with kv
//!   `flood-entries` data entries whose values all name one string of kv
//!   `flood-bytes` bytes (aliased: the host copies it once per entry), returning `flooded`;
//! - `records`: returns kv `flood-entries` instances, each with its own id;
//! - `aliased-records`: as `records`, every message naming one string of kv
//!   `flood-bytes` bytes (the host must refuse the copy: the guest's frees
//!   after such an answer would be wrong);
//! - `kv-flood`: sets kv keys `flood/0`, `flood/1` … to values of kv
//!   `flood-bytes` bytes until the host refuses one, returning instance
//!   `refused-after-<n>` whose message is the refusal;
//! - `log-flood`: writes kv `flood-entries` lines to stderr (no grant needed:
//!   they reach the host's log as guest output), returning `logged`;
//! - `http:<METHOD>:<authority>:<path>`: one request through the SDK's client,
//!   its body kv `http-body` (a form when kv `http-form` is `yes`), writing
//!   status, headers and body to kv `http-response`, returning `answered-<status>`
//!   (a refusal is the guest's error, its text the SDK's);
//! - `leak`: (in `start-instance` too) hands its config's `api-token` back in
//!   everything the host shows: stdout, stderr, a status (info and data), its
//!   error; kv `leaked` keeps what it was given.
//! - `leak-record`: reports one instance, `leaked`, whose message has the token.
//! - `snoop`: looks everywhere a guest can for a secret: its environment,
//!   arguments, config, and every file under `/data` and `/`, writing what it
//!   saw to kv `snooped`, returning `snooped`.
//!
//! Numbers in kv are decimal text.
//!
//! `start-instance` returns an instance whose id is kv key `start-id`, verbatim,
//! in the zone kv `start-zone` names, verbatim, when those are set (and refuses
//! without an id); `stop-instances` appends the ids it
//! is given, NUL-separated, to kv key `stopped`. The other methods behave.

use broker_guest::types::{
    Address, AddressConfigType, AddressKind, AddressScope, BrokerError, HardwareCharacteristics, Instance,
    InstancePage, InstanceStatus, PageRequest, ProviderInfo, StartInstanceParams, StartInstanceResult,
};
use broker_guest::{CallContext, Guest, host_kv, machine_lock, network_bridge, process};
use std::sync::atomic::{AtomicU64, Ordering};

static CALLS_SERVED: AtomicU64 = AtomicU64::new(0);

/// The modes that make one network-bridge call.
const NETWORK_CALLS: &[&str] = &["bridge-to", "tap", "veth", "attach", "unbridge", "delete-link"];

struct Hostile;

/// Kv `mode`, else the config's `mode` (a daemon's test cannot write kv), else `count`.
fn mode(ctx: &CallContext) -> String {
    match host_kv::get("mode") {
        Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
        _ => config_value(ctx, "mode").unwrap_or_else(|| "count".into()),
    }
}

/// A string or number at the top of the config's JSON (`"key":"text"` or
/// `"key":123`, as the host writes it: compact).
fn config_value(ctx: &CallContext, key: &str) -> Option<String> {
    let config = ctx.provider_config();
    let at = config.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &config[at..];
    match rest.strip_prefix('"') {
        Some(text) => Some(text[..text.find('"')?].to_owned()),
        None => Some(rest.chars().take_while(char::is_ascii_digit).collect()),
    }
}

impl Guest for Hostile {
    fn describe() -> ProviderInfo {
        // It claims id-ordered pages, whatever its mode lists.
        let features = vec![broker_guest::listing::ID_ORDERED_PAGES.into()];
        ProviderInfo { name: "hostile".into(), version: env!("CARGO_PKG_VERSION").into(), features }
    }

    /// Traps on a config that mentions `trap-validate` (hot-swap refusal tests).
    fn validate_config(config: String) -> Result<(), BrokerError> {
        if config.contains("trap-validate") {
            panic!("validate-config was told to trap");
        }
        Ok(())
    }

    fn start_instance(ctx: &CallContext, _params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        if mode(ctx) == "leak" {
            return Err(leak(ctx));
        }
        if mode(ctx) == "status-flood" {
            Self::whole_listing(ctx)?;
            let id = format!("flood-{}", CALLS_SERVED.load(Ordering::SeqCst));
            return Ok(started(&id, None));
        }
        // Ids to claim, NUL-separated, in order: the host's checks of claims.
        if let Some(claims) = host_kv::get("claims")? {
            for id in claims.split(|b| *b == 0) {
                ctx.claim_instance_id(&String::from_utf8_lossy(id))?;
            }
            // Cut off after claiming: the deadline ends the call.
            if host_kv::get("after-claims")?.as_deref() == Some(b"spin") {
                #[allow(clippy::empty_loop)]
                loop {}
            }
        }
        let Some(id) = host_kv::get("start-id")? else {
            return Err(BrokerError::NotSupported("the hostile provider starts nothing".into()));
        };
        let id = String::from_utf8_lossy(&id).into_owned();
        let zone = host_kv::get("start-zone")?.map(|zone| String::from_utf8_lossy(&zone).into_owned());
        Ok(started(&id, zone))
    }

    fn stop_instances(_ctx: &CallContext, ids: Vec<String>) -> Result<(), BrokerError> {
        let mut stopped = host_kv::get("stopped")?.unwrap_or_default();
        for id in ids {
            stopped.extend_from_slice(id.as_bytes());
            stopped.push(0);
        }
        host_kv::set("stopped", &stopped)?;
        Ok(())
    }

    /// Its whole listing, cut into the page asked for.
    fn all_instances(ctx: &CallContext, page: PageRequest) -> Result<InstancePage, BrokerError> {
        match mode(ctx).as_str() {
            // A page of more than asked for: the host refuses it.
            "page-overrun" => {
                let all = (0..=page.size).map(|i| broker_guest::listing::listed(instance(&format!("i-{i}"))));
                return Ok(InstancePage { instances: all.collect(), next: None });
            }
            // A cursor that never moves: the listing would never end.
            "same-cursor" => return Ok(InstancePage { instances: Vec::new(), next: Some("again".into()) }),
            // The secret in everything a listing says of an instance besides its message.
            // Each page in id order, the pages backwards: a page's ids are below the page before's.
            "pages-backwards" => {
                let count = number(ctx, "flood-entries")?;
                let size = page.size.max(1) as usize;
                let pages = count.div_ceil(size).max(1);
                let at: usize = page.cursor.as_deref().and_then(|c| c.strip_prefix('p')?.parse().ok()).unwrap_or(0);
                let chunk = pages.saturating_sub(at + 1);
                let ids = (chunk * size..count.min((chunk + 1) * size)).map(|i| format!("i-{i:04}"));
                let instances = ids.map(|id| broker_guest::listing::listed(instance(&id))).collect();
                let next = (at + 1 < pages).then(|| format!("p{}", at + 1));
                return Ok(InstancePage { instances, next });
            }
            // Empty pages without end, its cursor going back and forth.
            "pages-endless" => {
                let next = if page.cursor.as_deref() == Some("a") { "b" } else { "a" };
                return Ok(InstancePage { instances: Vec::new(), next: Some(next.into()) });
            }
            // A page whose ids are not in order, then its last page.
            "page-unsorted" => {
                let ids: &[&str] = if page.cursor.is_none() { &["i-2", "i-1"] } else { &["i-3"] };
                let instances = ids.iter().map(|id| broker_guest::listing::listed(instance(id))).collect();
                return Ok(InstancePage { instances, next: page.cursor.is_none().then(|| "second".into()) });
            }
            // The secret as the cursor of its next page: the host must not hand it out.
            "leak-cursor" => {
                let token = config_value(ctx, "api-token").unwrap_or_default();
                let first = page.cursor.is_none();
                let id = if first { "i-1" } else { "i-2" };
                let next = first.then(|| format!("after-{token}"));
                return Ok(InstancePage { instances: vec![broker_guest::listing::listed(instance(id))], next });
            }
            "leak-record" => {
                let token = config_value(ctx, "api-token").unwrap_or_default();
                let mut listed = broker_guest::listing::listed(Self::whole_listing(ctx)?.remove(0));
                listed.display_name = format!("named {token}");
                listed.instance.addresses.push(Address {
                    value: format!("{token}.example"),
                    kind: AddressKind::Hostname,
                    scope: AddressScope::Public,
                    cidr: None,
                    config_type: AddressConfigType::Unknown,
                });
                listed.hardware = Some(HardwareCharacteristics {
                    availability_zone: Some(format!("zone-{token}")),
                    tags: Some(vec![token.clone()]),
                    ..hardware()
                });
                return Ok(InstancePage { instances: vec![listed], next: None });
            }
            _ => {}
        }
        let all = Self::whole_listing(ctx)?.into_iter().map(broker_guest::listing::listed).collect();
        Ok(broker_guest::listing::page_of(all, &page))
    }

    fn maintain_instance(_ctx: &CallContext, _id: String, _params: StartInstanceParams) -> Result<(), BrokerError> {
        Ok(())
    }
}

impl Hostile {
    /// Every instance it lists, as one answer.
    fn whole_listing(ctx: &CallContext) -> Result<Vec<Instance>, BrokerError> {
        let served = CALLS_SERVED.fetch_add(1, Ordering::SeqCst) + 1;
        match mode(ctx).as_str() {
            "status-flood" => {
                let value = "v".repeat(number(ctx, "flood-bytes")?);
                let data = aliased((0..number(ctx, "flood-entries")?).map(|i| format!("k{i}")), &value);
                for _ in 0..number(ctx, "flood-calls")? {
                    ctx.set_status(InstanceStatus::Allocating, "flooding", &data)?;
                }
                // The values were never allocated apart: never free them.
                std::mem::forget(data);
                Ok(vec![instance("flooded")])
            }
            "leak" => Err(leak(ctx)),
            "leak-record" => {
                let token = config_value(ctx, "api-token").unwrap_or_default();
                let mut reported = instance("leaked");
                reported.message = format!("reachable with {token}");
                Ok(vec![reported])
            }
            "records" => Ok((0..number(ctx, "flood-entries")?).map(|i| instance(&format!("i-{i}"))).collect()),
            "aliased-records" => {
                // Leaked: the answer names it after this function returns.
                let message: &'static str = "m".repeat(number(ctx, "flood-bytes")?).leak();
                let messages = aliased(0..number(ctx, "flood-entries")?, message);
                Ok(messages
                    .into_iter()
                    .map(|(i, message)| Instance { message, ..instance(&format!("i-{i}")) })
                    .collect())
            }
            // Compare-and-swap and a transaction, each answer in order as one message.
            "kv-cas" => {
                use broker_guest::kv::{KvOp, delete_if_equal, set_if_absent, set_if_equal, transact};
                let answers = [
                    set_if_absent("cas", b"1")?,
                    set_if_absent("cas", b"2")?,
                    set_if_equal("cas", b"2", b"3")?,
                    set_if_equal("cas", b"1", b"3")?,
                    transact(&[
                        KvOp::ExpectEqual(("cas".into(), b"3".to_vec())),
                        KvOp::Set(("other".into(), b"x".to_vec())),
                    ])?,
                    transact(&[
                        KvOp::ExpectAbsent("other".into()),
                        KvOp::Delete("cas".into()),
                        KvOp::Set(("never".into(), b"y".to_vec())),
                    ])?,
                    delete_if_equal("other", b"y")?,
                    delete_if_equal("other", b"x")?,
                ];
                let held = [host_kv::get("cas")?, host_kv::get("other")?, host_kv::get("never")?];
                let message = format!("{answers:?} {held:?}");
                Ok(vec![Instance { message, ..instance("cas") }])
            }
            "kv-flood" => {
                let value = vec![7u8; number(ctx, "flood-bytes")?];
                let mut written = 0;
                let refusal = loop {
                    match host_kv::set(&format!("flood/{written}"), &value) {
                        Ok(()) => written += 1,
                        Err(refused) => break format!("{refused:?}"),
                    }
                };
                Ok(vec![Instance { message: refusal, ..instance(&format!("refused-after-{written}")) }])
            }
            "log-flood" => {
                for i in 0..number(ctx, "flood-entries")? {
                    eprintln!("flood line {i}");
                }
                Ok(vec![instance("logged")])
            }
            "trap" => panic!("hostile guest traps on purpose"),
            "loop" => {
                let mut spins: u64 = 0;
                loop {
                    spins = std::hint::black_box(spins.wrapping_add(1));
                }
            }
            "spin-then-sleep" => {
                // Long enough to hold a turn of executor time, then a host
                // call (a timer) that outlasts any deadline.
                let began = std::time::Instant::now();
                let mut spins: u64 = 0;
                while began.elapsed() < std::time::Duration::from_millis(50) {
                    spins = std::hint::black_box(spins.wrapping_add(1));
                }
                std::thread::sleep(std::time::Duration::from_secs(600));
                Ok(vec![instance("slept")])
            }
            "fill" => {
                // 1 MiB blocks into the data dir until refused (the issue's
                // finding: 2000 MiB written in 4.7 s).
                use std::io::Write;
                let mut file =
                    std::fs::File::create("/data/fill").map_err(|e| BrokerError::Provider(format!("create: {e}")))?;
                let block = vec![7u8; 1 << 20];
                let mut written = 0u64;
                let refused = loop {
                    if let Err(e) = file.write_all(&block).and_then(|()| file.sync_data()) {
                        break e.to_string();
                    }
                    written += 1;
                    if written == 4096 {
                        break "not refused".into();
                    }
                };
                let mut answer = instance("filled");
                answer.message = format!("{written} MiB, then {refused}");
                Ok(vec![answer])
            }
            "scan-pages" => {
                // Every entry under "big/" a page at a time, then the whole at once.
                let page_bytes = number(ctx, "page-bytes")? as u32;
                let (mut entries, mut bytes) = (0usize, 0usize);
                broker_guest::kv::scan_each("big/", page_bytes, |_, value| {
                    entries += 1;
                    bytes += value.len();
                    Ok(())
                })?;
                let whole = match host_kv::scan("big/") {
                    Ok(packed) => format!("whole: {} bytes", packed.len()),
                    Err(e) => format!("whole: {e:?}"),
                };
                let mut answer = instance("scanned");
                answer.message = format!("{entries} entries, {bytes} bytes; {whole}");
                Ok(vec![answer])
            }
            "write-loop" => {
                host_kv::set("written", b"yes")?;
                host_kv::set("written-next", b"yes")?;
                let mut spins: u64 = 0;
                loop {
                    spins = std::hint::black_box(spins.wrapping_add(1));
                }
            }
            "memhog" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            mode @ ("lock" | "lock-leak") => {
                let guard = machine_lock::acquire("hostile", mode, 1000)?;
                if mode == "lock-leak" {
                    std::mem::forget(guard);
                } else {
                    guard.release();
                }
                Ok(vec![Instance {
                    id: "locked".into(),
                    status: InstanceStatus::Running,
                    message: String::new(),
                    addresses: vec![],
                }])
            }
            "run" => {
                let out = process::run("echo", &["hello".to_string()], &[], &[], 5000)?;
                Ok(vec![instance(String::from_utf8_lossy(&out.stdout).trim())])
            }
            "drop-in" => {
                // Attack: plant a manifest granting `sh` and `/`, and a component
                // beside it, where the host used to watch for drop-ins.
                let manifest =
                    "name = \"evil\"\ncomponent = \"evil.wasm\"\n[grants]\nprocess = [\"sh\"]\npaths = [\"/\"]\n";
                std::fs::write("/data/provider.toml", manifest)
                    .and_then(|_| std::fs::write("/data/evil.wasm", b"\0asm"))
                    .and_then(|_| std::fs::create_dir_all("/data/evil"))
                    .and_then(|_| std::fs::write("/data/evil/provider.toml", manifest))
                    .map_err(|e| BrokerError::Provider(format!("data dir: {e}")))?;
                Ok(vec![instance("dropped")])
            }
            "fs" => {
                let written = std::fs::write("/data/hello.txt", "written by the guest")
                    .and_then(|_| std::fs::read_to_string("/data/hello.txt"));
                let outside = std::fs::read_to_string("/etc/passwd").is_ok();
                match written {
                    Ok(text) if !outside => Ok(vec![instance(&text)]),
                    Ok(_) => Err(BrokerError::Provider("could read /etc/passwd".into())),
                    Err(e) => Err(BrokerError::Provider(format!("data dir: {e}"))),
                }
            }
            mode if mode.starts_with("http:") => {
                let mut parts = mode.splitn(4, ':').skip(1);
                let (method, authority, path) = (parts.next(), parts.next(), parts.next());
                let (Some(method), Some(authority), Some(path)) = (method, authority, path) else {
                    return Err(BrokerError::InvalidParams("http:<METHOD>:<authority>:<path>".into()));
                };
                let method = match method {
                    "GET" => broker_guest::http::Method::Get,
                    "POST" => broker_guest::http::Method::Post,
                    other => broker_guest::http::Method::Other(other.into()),
                };
                let mut request = broker_guest::http::Request::new(method, authority, path);
                if let Ok(Some(body)) = host_kv::get("http-body") {
                    request = match host_kv::get("http-form").ok().flatten().as_deref() == Some(b"yes") {
                        true => request.header("content-type", "application/x-www-form-urlencoded").body(body),
                        false => request.body(body),
                    };
                }
                let response = request.send().map_err(|e| BrokerError::Provider(e.to_string()))?;
                let mut seen = format!("{}\n", response.status).into_bytes();
                for (name, value) in &response.headers {
                    seen.extend_from_slice(format!("{name}: ").as_bytes());
                    seen.extend_from_slice(value);
                    seen.push(b'\n');
                }
                seen.push(b'\n');
                seen.extend_from_slice(&response.body);
                host_kv::set("http-response", &seen)?;
                Ok(vec![instance(&format!("answered-{}", response.status))])
            }
            "snoop" => {
                let mut seen = String::new();
                for (key, value) in std::env::vars() {
                    seen.push_str(&format!("env {key}={value}\n"));
                }
                for arg in std::env::args() {
                    seen.push_str(&format!("arg {arg}\n"));
                }
                seen.push_str(&format!("config {}\n", ctx.provider_config()));
                for root in ["/data", "/"] {
                    snoop_files(std::path::Path::new(root), 0, &mut seen);
                }
                host_kv::set("snooped", seen.as_bytes())?;
                Ok(vec![instance("snooped")])
            }
            mode if mode.split(':').next().is_some_and(|verb| NETWORK_CALLS.contains(&verb)) => {
                let args: Vec<&str> = mode.split(':').skip(1).collect();
                let arg = |i: usize| args.get(i).copied().unwrap_or_default();
                match mode.split(':').next().unwrap_or_default() {
                    "bridge-to" => network_bridge::bridge(&[network_bridge::DeviceToBridge {
                        device: arg(0).into(),
                        bridge: arg(1).into(),
                        mac: String::new(),
                    }])?,
                    "tap" => network_bridge::create_tap(arg(0), arg(1), "")?,
                    "veth" => network_bridge::create_veth(arg(0), arg(1), arg(2))?,
                    "attach" => network_bridge::attach(arg(0), arg(1))?,
                    "unbridge" => network_bridge::unbridge(arg(0), arg(1))?,
                    _ => network_bridge::delete_link(arg(0))?,
                }
                Ok(vec![instance("done")])
            }
            mode if mode.starts_with("bridge:") => {
                let device = &mode["bridge:".len()..];
                let change = network_bridge::DeviceToBridge {
                    device: device.into(),
                    bridge: network_bridge::bridge_name(device),
                    mac: String::new(),
                };
                network_bridge::bridge(&[change])?;
                let names: Vec<String> = network_bridge::devices()?.into_iter().map(|d| d.name).collect();
                Ok(vec![instance(&names.join(","))])
            }
            "ids" => {
                let ids = host_kv::get("ids")?.unwrap_or_default();
                let ids = String::from_utf8_lossy(&ids).into_owned();
                Ok(ids.split('\0').filter(|id| !id.is_empty()).map(instance).collect())
            }
            "symlink" => {
                // Attack: a link out of /data, for a granted program or the host to follow.
                #[allow(deprecated)] // the portable spelling; std's wasi symlink is unstable
                let made = std::fs::soft_link("../../../../../../etc/hostname", "/data/escape");
                match made {
                    Ok(()) => Ok(vec![instance("made")]),
                    Err(e) => Err(BrokerError::Provider(format!("symlink refused: {e}"))),
                }
            }
            "exec" => {
                let (program, args, env) = command()?;
                let out = process::run(&program, &args, &env, &[], 10_000)?;
                host_kv::set("exec-stderr", &out.stderr)?;
                Ok(vec![instance(&format!("exit-{}", out.exit_code.unwrap_or(-1)))])
            }
            "spawn" => {
                let (program, args, env) = command()?;
                let name = String::from_utf8_lossy(&host_kv::get("spawn-name")?.unwrap_or_default()).into_owned();
                process::spawn(&name, &program, &args, &env)?;
                Ok(vec![instance("spawned")])
            }
            "write" => {
                let path = String::from_utf8_lossy(&host_kv::get("write-path")?.unwrap_or_default()).into_owned();
                let bytes = host_kv::get("write-bytes")?.unwrap_or_default();
                let path = std::path::Path::new("/data").join(path);
                path.parent()
                    .map_or(Ok(()), std::fs::create_dir_all)
                    .and_then(|_| std::fs::write(&path, bytes))
                    .map_err(|e| BrokerError::Provider(format!("write {}: {e}", path.display())))?;
                Ok(vec![instance("written")])
            }
            "lock-as" => {
                let text =
                    |key| host_kv::get(key).map(|v| String::from_utf8_lossy(&v.unwrap_or_default()).into_owned());
                let guard = machine_lock::acquire(&text("lock-worker")?, &text("lock-comment")?, 1000)?;
                guard.release();
                Ok(vec![instance("locked")])
            }
            "forge" => {
                // A carriage return and an erase-line inside one line of output: on
                // a terminal the rest overwrites the host's own prefix.
                eprintln!("ok\r2026-12-04T00:00:00Z  INFO forged: a line without its provider\x1b[2K");
                Ok(vec![])
            }
            "print" => {
                println!("hello from the hostile guest's stdout");
                eprintln!("hello from the hostile guest's stderr");
                Ok(vec![])
            }
            _ => Ok(vec![Instance {
                id: served.to_string(),
                status: InstanceStatus::Running,
                message: String::new(),
                addresses: vec![],
            }]),
        }
    }
}

/// A program, its arguments and its environment.
type Command = (String, Vec<String>, Vec<(String, String)>);

/// What the test put in kv: `exec` = program NUL args…, `exec-env` = NAME=VALUE NUL …
/// Every file under `dir` (a few levels, a bounded amount), its content.
/// Every way a guest can hand the host text to show, each carrying its token.
fn leak(ctx: &CallContext) -> BrokerError {
    let token = config_value(ctx, "api-token").unwrap_or_default();
    if let Err(e) = host_kv::set("leaked", token.as_bytes()) {
        return e.into();
    }
    println!("stdout: my token is {token}");
    eprintln!("stderr: my config is {}", ctx.provider_config());
    let data = [("token".to_owned(), token.clone()), (format!("key-{token}"), "v".to_owned())];
    if let Err(e) = ctx.set_status(InstanceStatus::Allocating, &format!("using {token}"), &data) {
        return e;
    }
    BrokerError::AccessDenied(format!("the cloud refused token {token}"))
}

fn snoop_files(dir: &std::path::Path, depth: usize, seen: &mut String) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten().take(200) {
        let path = entry.path();
        seen.push_str(&format!("file {}\n", path.display()));
        match entry.file_type() {
            Ok(kind) if kind.is_dir() && depth < 4 => snoop_files(&path, depth + 1, seen),
            Ok(kind) if kind.is_file() && seen.len() < (128 << 10) => {
                if let Ok(bytes) = std::fs::read(&path) {
                    seen.push_str(&String::from_utf8_lossy(&bytes[..bytes.len().min(64 << 10)]));
                    seen.push('\n');
                }
            }
            _ => {}
        }
    }
}

fn command() -> Result<Command, BrokerError> {
    let words = host_kv::get("exec")?.unwrap_or_default();
    let mut words =
        String::from_utf8_lossy(&words).split('\0').filter(|w| !w.is_empty()).map(str::to_owned).collect::<Vec<_>>();
    let env = host_kv::get("exec-env")?.unwrap_or_default();
    let env = String::from_utf8_lossy(&env)
        .split('\0')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if words.is_empty() {
        return Err(BrokerError::InvalidParams("no exec".into()));
    }
    let program = words.remove(0);
    Ok((program, words, env))
}

/// A number the test put in kv as decimal text, else in the config.
fn number(ctx: &CallContext, key: &str) -> Result<usize, BrokerError> {
    let text = match host_kv::get(key)? {
        Some(text) => String::from_utf8_lossy(&text).into_owned(),
        None => config_value(ctx, key).unwrap_or_default(),
    };
    text.parse().map_err(|_| BrokerError::InvalidParams(format!("{key} is no number")))
}

/// Each of `keys` with a `String` that names the very bytes of `value`: the
/// list a hostile guest hands the host costs it one copy of `value`, however
/// many entries name it. The caller must never drop these values.
fn aliased<K>(keys: impl Iterator<Item = K>, value: &str) -> Vec<(K, String)> {
    keys.map(|key| {
        // SAFETY (as far as a hostile test guest goes): the bytes outlive the
        // list, are only read, and the copies are forgotten, never freed.
        let alias = unsafe { String::from_raw_parts(value.as_ptr().cast_mut(), value.len(), value.len()) };
        (key, alias)
    })
    .collect()
}

/// What a start answers for `id`, in `zone` if given.
fn started(id: &str, zone: Option<String>) -> StartInstanceResult {
    StartInstanceResult {
        display_name: id.to_owned(),
        instance: instance(id),
        config: vec![],
        hardware: zone.map(|zone| HardwareCharacteristics { availability_zone: Some(zone), ..hardware() }),
        network_info: vec![],
        volumes: vec![],
        volume_attachments: vec![],
    }
}

/// Hardware of which nothing is known.
fn hardware() -> HardwareCharacteristics {
    HardwareCharacteristics {
        arch: None,
        mem: None,
        root_disk: None,
        root_disk_source: None,
        cpu_cores: None,
        cpu_power: None,
        tags: None,
        availability_zone: None,
        virt_type: None,
    }
}

fn instance(id: &str) -> Instance {
    Instance { id: id.to_owned(), status: InstanceStatus::Running, message: String::new(), addresses: vec![] }
}

broker_guest::export_provider!(Hostile);
