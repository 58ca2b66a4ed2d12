//! Compiled components kept on disk, and compiled apart from the daemon.
//!
//! Compiling a component takes tens of MiB of heap (cranelift's) and pages in
//! the compiler's code; a process that compiled keeps most of both. So the
//! `broker` binary compiles in a child of itself ([`compile_in_children`],
//! [`COMPILE_ARG`]): the child reads the component on stdin, writes the
//! engine's artifact to a file the host opened, and exits, taking its memory
//! with it. The artifact is kept under the host's cache dir, named by the
//! component's SHA-256 and the engine's settings, and mapped from there: a
//! component loaded from it costs no compile and little anonymous memory.
//!
//! A process that never said where its compiler is (the tests, a library
//! user) compiles in-process, into the same store.
//!
//! A component is the operator's to add, but its author's to write: the
//! compiler child is held to [`CompileLimits`] (the memory it may map for its
//! data, the time it may take) and refused past them, so no component can
//! make a compile take the machine's memory or hold up every later load.

// Audited: loading an artifact is `unsafe` in wasmtime because it trusts the
// machine code inside. Only files this module wrote are loaded: in the host's
// own cache dir (0700, the host's, no symlink; the state dir, never a
// provider's), opened without following a link and checked to be a regular
// file of the host's with one name, made by this engine's settings (the name
// says which; wasmtime checks them again), synced before they were given
// their name, so no torn file is ever read as code. When the disk cannot keep
// an artifact, the one loaded is the memory file the compiler child wrote: made
// by this process, handed to that child alone, which has exited.
#![allow(unsafe_code)]

use super::RuntimeError;
use std::collections::HashSet;
use std::fs::File;
use std::hash::{Hash, Hasher};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The first argument that makes the `broker` binary a compiler child.
pub const COMPILE_ARG: &str = "__compile-component";

/// The child's exit code when the compiler refused the component (its words on stderr).
const REFUSED: u8 = 1;
/// The child's exit code when it compiled but could not write the artifact.
const UNWRITTEN: u8 = 2;

/// Artifacts kept, besides those this process has loaded; past this many
/// the ones used longest ago go.
const KEPT: usize = 32;

/// Most an artifact may take (a component is at most 64 MiB).
const MAX_ARTIFACT_BYTES: u64 = 1 << 30;

/// What the child said on stderr that is shown: its error's text.
const MAX_CHILD_STDERR: u64 = 4 << 10;

/// What one compile in a child may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompileLimits {
    /// Memory the child may map for its data (heap, thread stacks) beyond
    /// what it holds when it starts compiling: past it an allocation fails
    /// and the child ends.
    pub memory_bytes: u64,
    /// From the child's start to its end; past it the child is killed.
    pub timeout: Duration,
}

impl Default for CompileLimits {
    /// Room for the largest component a manifest may name (64 MiB).
    fn default() -> Self {
        CompileLimits { memory_bytes: 4 << 30, timeout: Duration::from_secs(300) }
    }
}

static COMPILER: OnceLock<(PathBuf, CompileLimits)> = OnceLock::new();

/// Compile components in children of `program` (run with [`COMPILE_ARG`],
/// it must call [`compiler_child_main`]), each held to `limits`: the `broker`
/// binary says so of itself at its start. Later calls change nothing.
pub fn compile_in_children(program: PathBuf, limits: CompileLimits) {
    let _ = COMPILER.set((program, limits));
}

/// The compiler child: a component on stdin, the artifact of this engine's
/// settings on stdout; else its error on stderr, and exit code [`REFUSED`]
/// (the compiler's refusal) or [`UNWRITTEN`] (the artifact not written).
/// Its argument after [`COMPILE_ARG`] is the memory it may take, in bytes.
pub fn compiler_child_main() -> ExitCode {
    // Gone with the host that asked; never writing more than an artifact may hold.
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_FSIZE,
        MAX_ARTIFACT_BYTES,
        MAX_ARTIFACT_BYTES,
    );
    // A compile ended past its budget dumps no core of its gigabytes.
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
    // Any thread's panic ends the child at once, its message said plainly: a
    // default hook's backtrace would allocate past a spent budget and wait
    // forever on the lock the allocation error's report then takes.
    std::panic::set_hook(Box::new(|info| {
        let _ = writeln!(std::io::stderr(), "{info}");
        std::process::abort();
    }));
    let compiled = (|| -> Result<Vec<u8>, String> {
        let memory_bytes = std::env::args()
            .nth(2)
            .and_then(|bytes| bytes.parse::<u64>().ok())
            .ok_or("the compiler child was not told how much memory it may take")?;
        let mut bytes = Vec::new();
        std::io::stdin()
            .take(crate::manifest::MAX_COMPONENT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read the component: {e}"))?;
        if bytes.len() as u64 > crate::manifest::MAX_COMPONENT_BYTES {
            return Err("the component is larger than a component may be".into());
        }
        let engine = Engine::new(&super::engine_config()).map_err(|e| format!("{e:#}"))?;
        // After the engine's own reservations: the budget is the compile's.
        limit_data(memory_bytes)?;
        precompile(&engine, &bytes)
    })();
    let artifact = match compiled {
        Ok(artifact) => artifact,
        Err(message) => {
            eprint!("{message}");
            return ExitCode::from(REFUSED);
        }
    };
    // Flushed here, its error seen: an artifact cut short must not exit 0.
    let mut out = std::io::stdout().lock();
    match out.write_all(&artifact).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("cannot write the compiled component: {e}");
            ExitCode::from(UNWRITTEN)
        }
    }
}

/// Hold this process's data mappings (heap, thread stacks: what `RLIMIT_DATA`
/// counts) to what it has now and `budget` more.
fn limit_data(budget: u64) -> Result<(), String> {
    let status =
        std::fs::read_to_string("/proc/self/status").map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    let held_kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmData:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or("/proc/self/status says nothing of VmData")?;
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let cannot = |e: nix::Error| format!("cannot bound the compiler's memory: {e}");
    // Within a hard limit the host was given (raising it would be refused).
    let (_, hard) = getrlimit(Resource::RLIMIT_DATA).map_err(cannot)?;
    let limit = held_kib.saturating_mul(1024).saturating_add(budget).min(hard);
    setrlimit(Resource::RLIMIT_DATA, limit, limit).map_err(cannot)
}

/// The engine's artifact of `bytes`, held to [`MAX_ARTIFACT_BYTES`].
fn precompile(engine: &Engine, bytes: &[u8]) -> Result<Vec<u8>, String> {
    let artifact = engine.precompile_component(bytes).map_err(|e| format!("{e:#}"))?;
    if artifact.len() as u64 > MAX_ARTIFACT_BYTES {
        return Err(format!("its compiled code is larger than {} MiB", MAX_ARTIFACT_BYTES >> 20));
    }
    Ok(artifact)
}

/// The artifacts of one engine, in one directory.
pub(crate) struct CompiledStore {
    dir: PathBuf,
    /// Names the engine's settings: an artifact of others is never looked for.
    engine_key: String,
    /// One compile at a time: each takes every core, and a second load of a
    /// component being compiled waits for its artifact instead.
    compiling: Mutex<()>,
    /// Artifacts this process loaded: never trimmed, so that a host with
    /// more components than [`KEPT`] does not compile them all at each start.
    loaded: Mutex<HashSet<PathBuf>>,
}

impl CompiledStore {
    /// The store in `dir`: made 0700 if missing, refused unless it is a
    /// directory of this user's that only it can use (an older host's `0755`
    /// is narrowed). What a killed compile left there goes, and what
    /// wasmtime's own cache kept there before.
    pub(crate) fn open(dir: &Path, engine: &Engine) -> std::io::Result<CompiledStore> {
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        let meta = std::fs::symlink_metadata(dir)?;
        let refuse = |why: &str| Err(std::io::Error::other(format!("{} {why}", dir.display())));
        if !meta.is_dir() {
            return refuse("is not a directory (a link is not followed)");
        }
        if meta.uid() != rustix::process::geteuid().as_raw() {
            return refuse("belongs to another user");
        }
        if meta.mode() & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
        let mut hasher = std::hash::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let store = CompiledStore {
            dir: dir.to_owned(),
            engine_key: format!("{:016x}", hasher.finish()),
            compiling: Mutex::new(()),
            loaded: Mutex::default(),
        };
        for (path, _) in store.entries(".tmp") {
            let _ = std::fs::remove_file(path);
        }
        let old_cache = dir.join("modules");
        if std::fs::symlink_metadata(&old_cache).is_ok_and(|m| m.is_dir()) {
            let _ = std::fs::remove_dir_all(old_cache);
        }
        Ok(store)
    }

    /// The component whose bytes are `bytes` (SHA-256 `sha256`, from `path`):
    /// mapped from its artifact, compiled (apart, if this process can) first
    /// if there is none.
    pub(crate) fn component(
        &self,
        engine: &Engine,
        path: &Path,
        bytes: &[u8],
        sha256: &str,
    ) -> Result<Component, RuntimeError> {
        let kept = self.dir.join(format!("{sha256}-{}.cwasm", self.engine_key));
        if let Some(component) = self.load_kept(engine, &kept) {
            return Ok(component);
        }
        let _one_at_a_time = self.compiling.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Compiled by the load this one waited for.
        if let Some(component) = self.load_kept(engine, &kept) {
            return Ok(component);
        }
        let compile_error =
            |cause: CompilerText| RuntimeError::Compile { path: path.display().to_string(), cause: Box::new(cause) };
        // Its own name: a load in another thread never writes the same file.
        static ATTEMPT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let attempt = ATTEMPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self.dir.join(format!("{sha256}.{}-{attempt}.tmp", std::process::id()));
        let here = || {
            precompile(engine, bytes).map_err(Failed::Refused).and_then(|a| write_new(&tmp, &a).map_err(Failed::Unkept))
        };
        let made = match COMPILER.get() {
            // Never compiled here once a compiler child is named: only the child is held to the limits.
            Some((program, limits)) => match compile_apart(program, limits, bytes) {
                Ok(mut artifact) => match write_new_from(&tmp, &mut artifact) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let _ = std::fs::remove_file(&tmp);
                        // A full or read-only disk: the child's artifact is mapped from memory, kept nowhere.
                        tracing::warn!(dir = %self.dir.display(), error = %e, "cannot keep a compiled component: it is loaded from memory");
                        let loaded = load(
                            engine,
                            Path::new(&format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&artifact))),
                        );
                        return loaded.map_err(|e| {
                            compile_error(CompilerText(format!("its compiled code does not load: {e:#}")))
                        });
                    }
                },
                Err(refused) => Err(Failed::Refused(refused)),
            },
            None => here(),
        };
        // Named only once whole and synced: the name is what a later load trusts.
        match made.and_then(|()| std::fs::rename(&tmp, &kept).map_err(Failed::Unkept)) {
            Ok(()) => {}
            Err(Failed::Refused(text)) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(compile_error(CompilerText(text)));
            }
            Err(Failed::Unkept(e)) => {
                let _ = std::fs::remove_file(&tmp);
                // A full or read-only disk: compile here, keep nothing.
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot keep a compiled component: compiling it in this process");
                return super::compile_here(engine, path, bytes);
            }
        }
        if let Err(e) = File::open(&self.dir).and_then(|dir| dir.sync_all()) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "the compiled component's name may not survive a crash");
        }
        match self.load_checked(engine, &kept) {
            Ok(component) => {
                // After the load: the new artifact counts as loaded.
                self.trim();
                Ok(component)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&kept);
                Err(compile_error(CompilerText(format!("its compiled code does not load: {e:#}"))))
            }
        }
    }

    /// The kept artifact at `kept`, if there is one that loads; one that is
    /// there but does not load (damaged, or not ours) is removed.
    fn load_kept(&self, engine: &Engine, kept: &Path) -> Option<Component> {
        match self.load_checked(engine, kept) {
            Ok(component) => Some(component),
            Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) => {
                None
            }
            // Out of descriptors or address space: the file is not to blame.
            Err(e) if e.downcast_ref::<std::io::Error>().is_some() => {
                tracing::warn!(artifact = %kept.display(), error = %format!("{e:#}"), "cannot open a kept compiled component");
                None
            }
            Err(e) => {
                tracing::warn!(artifact = %kept.display(), error = %format!("{e:#}"), "a kept compiled component does not load: compiling it again");
                let _ = std::fs::remove_file(kept);
                None
            }
        }
    }

    /// Map the artifact at `kept`: opened without following a link, and a
    /// regular file of this user's, with this one name, or refused.
    fn load_checked(&self, engine: &Engine, kept: &Path) -> wasmtime::Result<Component> {
        let file =
            std::fs::OpenOptions::new().read(true).custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits()).open(kept)?;
        let meta = file.metadata()?;
        if !meta.is_file() || meta.uid() != rustix::process::geteuid().as_raw() || meta.nlink() != 1 {
            return Err(wasmtime::Error::msg("not a file this host wrote (a special file, another user's, or linked)"));
        }
        // The very file checked, by its descriptor.
        let component = load(engine, Path::new(&format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file))))?;
        // Used now: the last to go when the store is trimmed.
        let _ = file.set_modified(std::time::SystemTime::now());
        self.loaded.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(kept.to_owned());
        Ok(component)
    }

    /// Files of the store whose names end in `suffix`, with when each was last used.
    fn entries(&self, suffix: &str) -> Vec<(PathBuf, std::time::SystemTime)> {
        let Ok(listing) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        listing
            .flatten()
            .filter(|entry| entry.file_name().to_string_lossy().ends_with(suffix))
            .filter_map(|entry| {
                // Not followed: the store holds regular files only.
                let meta = entry.metadata().ok().filter(|m| m.is_file())?;
                Some((entry.path(), meta.modified().ok()?))
            })
            .collect()
    }

    /// Keep the [`KEPT`] artifacts used last, and every one this process loaded.
    fn trim(&self) {
        let loaded = self.loaded.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let mut kept: Vec<_> = self.entries(".cwasm").into_iter().filter(|(path, _)| !loaded.contains(path)).collect();
        if kept.len() <= KEPT {
            return;
        }
        kept.sort_by_key(|(_, used)| std::cmp::Reverse(*used));
        for (path, _) in kept.drain(KEPT..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Why no artifact was made.
enum Failed {
    /// The compiler refused the component, or its process died: its words.
    Refused(String),
    /// The artifact could not be written (by a process that compiles in
    /// itself, having no child): it compiles, and keeps nothing.
    Unkept(std::io::Error),
}

/// A compiler's message as an error cause.
#[derive(Debug)]
struct CompilerText(String);

impl std::fmt::Display for CompilerText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CompilerText {}

/// Map an artifact this store wrote.
fn load(engine: &Engine, artifact: &Path) -> wasmtime::Result<Component> {
    // SAFETY: see the module's note: only artifacts this module wrote, synced,
    // in the host's own directory, of this engine's settings, checked by
    // their descriptor before this.
    unsafe { Component::deserialize_file(engine, artifact) }
}

/// `bytes` into a new file at `path` (0600), synced.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// `artifact` (read from its start) into a new file at `path` (0600), synced.
fn write_new_from(path: &Path, artifact: &mut File) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    artifact.rewind()?;
    std::io::copy(artifact, &mut file)?;
    file.sync_all()
}

/// A new memory-backed file (no disk needed, gone with its last descriptor).
fn memory_file(name: &str) -> std::io::Result<File> {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
    Ok(File::from(fd))
}

/// Compile `bytes` in a child of `program`, held to `limits`: the artifact,
/// in a memory-backed file; else why not, as the user is told.
fn compile_apart(program: &Path, limits: &CompileLimits, bytes: &[u8]) -> Result<File, String> {
    let cannot_run = |e: std::io::Error| format!("cannot run the compiler process: {e}");
    // The component, the artifact and the child's words go through unnamed
    // files in memory, not pipes (nothing to pump, nothing that blocks on a
    // full pipe) nor the disk (a full one does not stop a compile).
    let mut input = memory_file("component").map_err(cannot_run)?;
    input.write_all(bytes).and_then(|()| input.rewind()).map_err(cannot_run)?;
    let mut stderr = memory_file("compiler-stderr").map_err(cannot_run)?;
    let output = memory_file("artifact").map_err(cannot_run)?;
    let mut child = Command::new(program)
        .arg(COMPILE_ARG)
        .arg(limits.memory_bytes.to_string())
        .stdin(Stdio::from(input))
        .stdout(Stdio::from(output.try_clone().map_err(cannot_run)?))
        .stderr(Stdio::from(stderr.try_clone().map_err(cannot_run)?))
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .spawn()
        .map_err(cannot_run)?;
    let Some(status) = wait_for(&mut child, limits.timeout).map_err(|e| {
        // Not left running unwatched.
        let _ = child.kill();
        let _ = child.wait();
        format!("cannot wait for the compiler process: {e}")
    })?
    else {
        return Err(format!(
            "the compiler took longer than {} and was stopped (`--compile-timeout` allows more)",
            humantime::format_duration(limits.timeout)
        ));
    };
    if status.success() {
        return Ok(output);
    }
    let mut said = Vec::new();
    let _ = stderr.rewind().and_then(|()| (&mut stderr).take(MAX_CHILD_STDERR).read_to_end(&mut said));
    // Rust's hint about backtraces says nothing of the failure.
    let said = String::from_utf8_lossy(&said);
    let said: Vec<&str> = said.lines().filter(|line| !line.starts_with("note: run with `RUST_BACKTRACE")).collect();
    let said = said.join("\n").trim().to_owned();
    let status_text = match (status.code(), std::os::unix::process::ExitStatusExt::signal(&status)) {
        (Some(code), _) if code == i32::from(REFUSED) && !said.is_empty() => return Err(said),
        (Some(code), _) if code == i32::from(UNWRITTEN) => return Err(format!("the compiler could not write: {said}")),
        (_, Some(signal)) => {
            let name = nix::sys::signal::Signal::try_from(signal).map_or(String::new(), |s| format!(" ({s})"));
            let oom = if signal == 9 { ", out of memory?" } else { "" };
            format!("the compiler process was killed by signal {signal}{name}{oom}")
        }
        _ => format!("the compiler process ended with {status}"),
    };
    // An allocation past the child's budget ends it (SIGABRT), or its threads cannot start.
    let budget = if ["memory allocation of", "out of memory", "ThreadPoolBuildError"].iter().any(|s| said.contains(s)) {
        format!(" (a compile may take {} MiB: `--compile-memory-mib` allows more)", limits.memory_bytes >> 20)
    } else {
        String::new()
    };
    let said = if said.is_empty() { String::new() } else { format!(": {said}") };
    Err(format!("{status_text}{said}{budget}"))
}

/// `child`'s exit status, or `None` once `timeout` has passed (the child is
/// then killed and reaped).
fn wait_for(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    // Short at first: most compiles take a fraction of a second.
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            let _ = child.kill();
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use crate::runtime::{Runtime, RuntimeError};
    use sha2::{Digest, Sha256};
    use std::path::Path;

    fn fake() -> (Vec<u8>, String) {
        let bytes = std::fs::read(guest_artifacts::wasm("fake")).unwrap();
        let sha256 = hex::encode(Sha256::digest(&bytes));
        (bytes, sha256)
    }

    fn artifacts(dir: &Path) -> Vec<std::path::PathBuf> {
        let mut found: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        found.sort();
        found
    }

    /// Compiled once, then mapped from the artifact: a second runtime (a
    /// restart) finds it, and an artifact that no longer loads (a damaged
    /// file) is compiled again, not run and not an error.
    #[test]
    fn a_component_is_kept_compiled_and_a_damaged_artifact_is_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let (bytes, sha256) = fake();
        let path = Path::new("fake.wasm");
        Runtime::new(Some(dir.path())).unwrap().compile(path, &bytes, &sha256).unwrap();
        let kept = artifacts(dir.path());
        assert_eq!(kept.len(), 1, "{kept:?}");
        let name = kept[0].file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&sha256) && name.ends_with(".cwasm"), "{name}");
        let made = std::fs::metadata(&kept[0]).unwrap().modified().unwrap();

        std::thread::sleep(std::time::Duration::from_millis(20));
        Runtime::new(Some(dir.path())).unwrap().compile(path, &bytes, &sha256).unwrap();
        assert_eq!(artifacts(dir.path()), kept, "loaded from the artifact, nothing new");
        assert!(std::fs::metadata(&kept[0]).unwrap().modified().unwrap() > made, "marked used");

        std::fs::write(&kept[0], b"\x7fELF and then not what wasmtime wrote").unwrap();
        Runtime::new(Some(dir.path())).unwrap().compile(path, &bytes, &sha256).unwrap();
        assert_eq!(artifacts(dir.path()), kept);
        assert!(std::fs::metadata(&kept[0]).unwrap().len() > 1024, "made again whole");
    }

    /// A compiler child past its time is killed and reaped, and the wait
    /// ends at the deadline, not when the child would have.
    #[test]
    fn a_child_past_its_time_is_killed_and_one_within_it_is_waited_for() {
        let started = std::time::Instant::now();
        let mut slow = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let waited = super::wait_for(&mut slow, std::time::Duration::from_millis(200)).unwrap();
        assert_eq!(waited, None, "timed out");
        assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", started.elapsed());
        let reaped = std::fs::read_to_string(format!("/proc/{}/stat", slow.id()));
        assert!(reaped.is_err(), "killed and reaped: {reaped:?}");

        let mut quick = std::process::Command::new("true").spawn().unwrap();
        let waited = super::wait_for(&mut quick, std::time::Duration::from_secs(30)).unwrap();
        assert!(waited.is_some_and(|status| status.success()));
    }

    /// What a killed compile left goes when the store opens; a component
    /// the compiler refuses leaves nothing behind.
    #[test]
    fn leftovers_go_and_a_refused_component_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("abc.123.tmp"), b"half").unwrap();
        let runtime = Runtime::new(Some(dir.path())).unwrap();
        assert!(artifacts(dir.path()).is_empty());
        let refused = runtime.compile(Path::new("junk.wasm"), b"\0asm\x0d\0\x01\0\xff", "junk").err();
        assert!(matches!(refused, Some(RuntimeError::Compile { .. })), "{refused:?}");
        assert!(artifacts(dir.path()).is_empty(), "{:?}", artifacts(dir.path()));
    }

    /// Past [`super::KEPT`] artifacts, the ones used longest ago go; one
    /// this process loaded stays whatever their number.
    #[test]
    fn the_store_keeps_the_artifacts_used_last_and_those_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = Runtime::new(Some(dir.path())).unwrap();
        let store = runtime.compiled.as_ref().unwrap();
        let now = std::time::SystemTime::now();
        let old = |n: usize| dir.path().join(format!("{n:064}-{}.cwasm", store.engine_key));
        for n in 0..=super::KEPT {
            std::fs::write(old(n), b"x").unwrap();
            let used = now - std::time::Duration::from_secs(3600 + n as u64);
            std::fs::File::options().write(true).open(old(n)).unwrap().set_modified(used).unwrap();
        }
        let (bytes, sha256) = fake();
        runtime.compile(Path::new("fake.wasm"), &bytes, &sha256).unwrap();
        let kept = artifacts(dir.path());
        assert_eq!(kept.len(), super::KEPT + 1, "{} others and the one loaded", super::KEPT);
        assert!(!kept.contains(&old(super::KEPT)), "the one used longest ago went");
        assert!(
            kept.iter().any(|p| p.file_name().unwrap().to_string_lossy().starts_with(&sha256)),
            "the new one stays"
        );
    }

    /// An artifact's name that is a link is never followed, even to a good
    /// artifact: the component is compiled again, and the link replaced by
    /// the host's own file. A cache dir that is a link is refused.
    #[test]
    fn a_link_is_never_mapped_as_code() {
        let dir = tempfile::tempdir().unwrap();
        let (bytes, sha256) = fake();
        Runtime::new(Some(dir.path())).unwrap().compile(Path::new("fake.wasm"), &bytes, &sha256).unwrap();
        let kept = artifacts(dir.path()).remove(0);
        let elsewhere = tempfile::tempdir().unwrap();
        let planted = elsewhere.path().join("planted.cwasm");
        std::fs::rename(&kept, &planted).unwrap();
        let good = std::fs::read(&planted).unwrap();
        std::os::unix::fs::symlink(&planted, &kept).unwrap();
        Runtime::new(Some(dir.path())).unwrap().compile(Path::new("fake.wasm"), &bytes, &sha256).unwrap();
        assert!(std::fs::symlink_metadata(&kept).unwrap().is_file(), "the link was not followed, but replaced");
        assert_eq!(std::fs::read(&planted).unwrap(), good, "what it pointed at is untouched");

        let linked = elsewhere.path().join("cache");
        std::os::unix::fs::symlink(dir.path(), &linked).unwrap();
        let refused = Runtime::new(Some(&linked)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("not a directory"), "{refused}");
    }
}
