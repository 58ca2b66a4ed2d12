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

// Audited: loading an artifact is `unsafe` in wasmtime because it trusts the
// machine code inside. Only files this module wrote are loaded: in the host's
// own cache dir (the state dir, never a provider's), made by this engine's
// settings (the name says which; wasmtime checks them again), synced before
// they are given their name, so no torn file is ever read as code.
#![allow(unsafe_code)]

use super::RuntimeError;
use std::fs::File;
use std::hash::{Hash, Hasher};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::OnceLock;
use wasmtime::Engine;
use wasmtime::component::Component;

/// The first argument that makes the `broker` binary a compiler child.
pub const COMPILE_ARG: &str = "__compile-component";

/// Artifacts kept; past this many the ones used longest ago go.
const KEPT: usize = 32;

/// Most an artifact may take (a component is at most 64 MiB).
const MAX_ARTIFACT_BYTES: u64 = 1 << 30;

/// What the child said on stderr that is shown: its error's text.
const MAX_CHILD_STDERR: u64 = 4 << 10;

static COMPILER: OnceLock<PathBuf> = OnceLock::new();

/// Compile components in children of `program` (run with [`COMPILE_ARG`],
/// it must call [`compiler_child_main`]): the `broker` binary says so of
/// itself at its start. Later calls change nothing.
pub fn compile_in_children(program: PathBuf) {
    let _ = COMPILER.set(program);
}

/// The compiler child: a component on stdin, the artifact of this engine's
/// settings on stdout, or an error on stderr and exit code 1.
pub fn compiler_child_main() -> ExitCode {
    let compiled = (|| -> Result<Vec<u8>, String> {
        let mut bytes = Vec::new();
        std::io::stdin()
            .take(crate::manifest::MAX_COMPONENT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read the component: {e}"))?;
        if bytes.len() as u64 > crate::manifest::MAX_COMPONENT_BYTES {
            return Err("the component is larger than a component may be".into());
        }
        let engine = Engine::new(&super::engine_config()).map_err(|e| format!("{e:#}"))?;
        let artifact = engine.precompile_component(&bytes).map_err(|e| format!("{e:#}"))?;
        if artifact.len() as u64 > MAX_ARTIFACT_BYTES {
            return Err(format!("its compiled code is larger than {} MiB", MAX_ARTIFACT_BYTES >> 20));
        }
        Ok(artifact)
    })();
    match compiled.and_then(|artifact| std::io::stdout().write_all(&artifact).map_err(|e| e.to_string())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprint!("{message}");
            ExitCode::from(1)
        }
    }
}

/// The artifacts of one engine, in one directory.
pub(crate) struct CompiledStore {
    dir: PathBuf,
    /// Names the engine's settings: an artifact of others is never looked for.
    engine_key: String,
}

impl CompiledStore {
    /// The store in `dir` (made if missing); what a killed compile left there goes.
    pub(crate) fn open(dir: &Path, engine: &Engine) -> std::io::Result<CompiledStore> {
        std::fs::DirBuilder::new().recursive(true).create(dir)?;
        let mut hasher = std::hash::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let store = CompiledStore { dir: dir.to_owned(), engine_key: format!("{:016x}", hasher.finish()) };
        for (path, _) in store.entries(".tmp") {
            let _ = std::fs::remove_file(path);
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
        if kept.exists() {
            match load(engine, &kept) {
                Ok(component) => {
                    // Used now: the last to go when the store is trimmed.
                    let _ = File::open(&kept).and_then(|f| f.set_modified(std::time::SystemTime::now()));
                    return Ok(component);
                }
                Err(e) => {
                    tracing::warn!(artifact = %kept.display(), error = %format!("{e:#}"), "a kept compiled component does not load: compiling it again");
                    let _ = std::fs::remove_file(&kept);
                }
            }
        }
        let compile_error =
            |cause: BoxedText| RuntimeError::Compile { path: path.display().to_string(), cause: Box::new(cause) };
        // Its own name: two loads of one component at once each make theirs.
        static ATTEMPT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let attempt = ATTEMPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self.dir.join(format!("{sha256}.{}-{attempt}.tmp", std::process::id()));
        let made = match COMPILER.get() {
            Some(program) => compile_apart(program, bytes, &tmp),
            None => engine
                .precompile_component(bytes)
                .map_err(|e| Failed::Compile(format!("{e:#}")))
                .and_then(|artifact| write_new(&tmp, &artifact).map_err(Failed::Keep)),
        };
        match made {
            Ok(()) => {}
            Err(Failed::Compile(text)) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(compile_error(BoxedText(text)));
            }
            Err(Failed::Keep(e)) => {
                let _ = std::fs::remove_file(&tmp);
                // A full or read-only disk: compile here, keep nothing.
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot keep a compiled component: compiling it in this process");
                return Component::new(engine, bytes).map_err(|e| RuntimeError::Compile {
                    path: path.display().to_string(),
                    cause: e.into_boxed_dyn_error(),
                });
            }
        }
        if let Err(e) = std::fs::rename(&tmp, &kept).and_then(|()| File::open(&self.dir)?.sync_all()) {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot keep a compiled component: compiling it in this process");
            return Component::new(engine, bytes).map_err(|e| RuntimeError::Compile {
                path: path.display().to_string(),
                cause: e.into_boxed_dyn_error(),
            });
        }
        self.trim();
        load(engine, &kept).map_err(|e| compile_error(BoxedText(format!("its compiled code does not load: {e:#}"))))
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

    /// Keep the [`KEPT`] artifacts used last.
    fn trim(&self) {
        let mut kept = self.entries(".cwasm");
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
    /// The compiler refused the component (or the child died): its words.
    Compile(String),
    /// No child could compile, or the artifact could not be written: this
    /// process compiles, and keeps nothing.
    Keep(std::io::Error),
}

/// A compiler's message as an error cause.
#[derive(Debug)]
struct BoxedText(String);

impl std::fmt::Display for BoxedText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BoxedText {}

/// Map an artifact this store wrote.
fn load(engine: &Engine, artifact: &Path) -> wasmtime::Result<Component> {
    // SAFETY: see the module's note: only artifacts this module wrote, synced,
    // in the host's own directory, of this engine's settings.
    unsafe { Component::deserialize_file(engine, artifact) }
}

/// `bytes` into a new file at `path`, synced.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Compile `bytes` in a child of `program` into a new file at `out`, synced.
fn compile_apart(program: &Path, bytes: &[u8], out: &Path) -> Result<(), Failed> {
    let dir = out.parent().unwrap_or(Path::new("."));
    // The component and the child's words go through unnamed files, not
    // pipes: nothing to pump, nothing that blocks on a full pipe.
    let mut input = tempfile::tempfile_in(dir).map_err(Failed::Keep)?;
    input.write_all(bytes).and_then(|()| input.rewind()).map_err(Failed::Keep)?;
    let mut stderr = tempfile::tempfile_in(dir).map_err(Failed::Keep)?;
    let output = std::fs::OpenOptions::new().write(true).create_new(true).open(out).map_err(Failed::Keep)?;
    let child_stderr = stderr.try_clone().map_err(Failed::Keep)?;
    let status = Command::new(program)
        .arg(COMPILE_ARG)
        .stdin(Stdio::from(input))
        .stdout(Stdio::from(output.try_clone().map_err(Failed::Keep)?))
        .stderr(Stdio::from(child_stderr))
        .env_remove("RUST_LOG")
        .status()
        .map_err(Failed::Keep)?;
    if status.success() {
        return output.sync_all().map_err(Failed::Keep);
    }
    let mut said = Vec::new();
    let _ = stderr.rewind().and_then(|()| (&mut stderr).take(MAX_CHILD_STDERR).read_to_end(&mut said));
    Err(Failed::Compile(match (status.code(), String::from_utf8_lossy(&said).trim()) {
        (Some(_), said) if !said.is_empty() => said.to_owned(),
        _ => format!("the compiler process ended with {status}"),
    }))
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

    /// Past [`super::KEPT`] artifacts, the ones used longest ago go.
    #[test]
    fn the_store_keeps_the_artifacts_used_last() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = Runtime::new(Some(dir.path())).unwrap();
        let store = runtime.compiled.as_ref().unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for n in 0..super::KEPT {
            let path = dir.path().join(format!("{n:064}-{}.cwasm", store.engine_key));
            std::fs::write(&path, b"x").unwrap();
            std::fs::File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        }
        let (bytes, sha256) = fake();
        runtime.compile(Path::new("fake.wasm"), &bytes, &sha256).unwrap();
        let kept = artifacts(dir.path());
        assert_eq!(kept.len(), super::KEPT);
        assert!(
            kept.iter().any(|p| p.file_name().unwrap().to_string_lossy().starts_with(&sha256)),
            "the new one stays"
        );
    }
}
