//! What a provider may run, and which paths its arguments may name.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

/// Why a grant is refused when a provider loads, or a call when it is made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// At load: not on the host's PATH.
    #[error("granted program {0:?} was not found on the host's PATH")]
    ProgramNotFound(String),
    /// At load: not a file with an execute bit.
    #[error("granted program {0:?} is not an executable file")]
    NotExecutable(String),
    /// At load: relative, or with `..` or `.`.
    #[error("granted path {0:?} must be absolute and free of '..'")]
    BadGrantedPath(String),
    /// A call for a program not in `process = [...]`.
    #[error("program {0:?} is not granted: add it to `process = [...]` under [grants]")]
    ProgramDenied(String),
    /// A call whose argument names a path it may not.
    #[error("argument path {0:?} is outside the provider's data dir and its granted paths")]
    PathDenied(String),
    /// A call on a host without confinement.
    #[error("granted programs run only confined, and this host has no confinement for them")]
    Unconfined,
}

/// The guest's name for its own data dir.
pub(crate) const GUEST_DATA_DIR: &str = "/data";

/// Resolved grants for `process`.
#[derive(Debug, Clone)]
pub struct ProcessPolicy {
    /// Granted name (as the manifest lists it) -> absolute path.
    programs: HashMap<String, PathBuf>,
    /// Host paths (files or directories) arguments may name, besides the data dir.
    paths: Vec<PathBuf>,
    data_dir: PathBuf,
    /// How the programs run on the host: `None` in a simulated process table,
    /// where nothing runs; the host refuses to run a program without it.
    confinement: Option<std::sync::Arc<crate::sandbox::Confinement>>,
    /// Environment names granted besides [`crate::sandbox::BASE_ENV`].
    env: Vec<String>,
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn is_clean_absolute(path: &Path) -> bool {
    path.is_absolute() && !path.components().any(|c| matches!(c, Component::ParentDir | Component::CurDir))
}

impl ProcessPolicy {
    /// Resolve granted programs to absolute paths now, once: a later change of
    /// PATH cannot redirect what a provider runs.
    pub fn resolve(programs: &[String], paths: &[PathBuf], data_dir: &Path) -> Result<ProcessPolicy, PolicyError> {
        let search: Vec<PathBuf> =
            std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
        let mut resolved = HashMap::new();
        for program in programs {
            let path = if program.contains('/') {
                let path = PathBuf::from(program);
                if !is_clean_absolute(&path) {
                    return Err(PolicyError::BadGrantedPath(program.clone()));
                }
                if !is_executable(&path) {
                    return Err(PolicyError::NotExecutable(program.clone()));
                }
                path
            } else {
                search
                    .iter()
                    .map(|dir| dir.join(program))
                    .find(|candidate| is_executable(candidate))
                    .ok_or_else(|| PolicyError::ProgramNotFound(program.clone()))?
            };
            resolved.insert(program.clone(), path);
        }
        ProcessPolicy::with_programs(resolved, paths, data_dir)
    }

    /// The same grants for a simulated process table (the conformance kit):
    /// granted programs are not looked up, as they need not exist on this host.
    pub fn unresolved(programs: &[String], paths: &[PathBuf], data_dir: &Path) -> Result<ProcessPolicy, PolicyError> {
        let programs = programs.iter().map(|p| (p.clone(), PathBuf::from(p))).collect();
        ProcessPolicy::with_programs(programs, paths, data_dir)
    }

    fn with_programs(
        programs: HashMap<String, PathBuf>,
        paths: &[PathBuf],
        data_dir: &Path,
    ) -> Result<ProcessPolicy, PolicyError> {
        for path in paths {
            if !is_clean_absolute(path) {
                return Err(PolicyError::BadGrantedPath(path.display().to_string()));
            }
        }
        Ok(ProcessPolicy {
            programs,
            paths: paths.to_vec(),
            data_dir: data_dir.to_owned(),
            confinement: None,
            env: Vec::new(),
        })
    }

    /// The same policy, its programs run in `confinement`.
    pub fn confined(self, confinement: crate::sandbox::Confinement) -> ProcessPolicy {
        ProcessPolicy { confinement: Some(std::sync::Arc::new(confinement)), ..self }
    }

    /// The same policy with `names` granted to the programs' environment.
    pub(crate) fn with_env(self, names: &[String]) -> Result<ProcessPolicy, crate::sandbox::SandboxError> {
        crate::sandbox::check_env_grant(names)?;
        Ok(ProcessPolicy { env: names.to_vec(), ..self })
    }

    /// Check the environment a guest asks for: allow-listed names only.
    pub(crate) fn check_env(&self, env: &[(String, String)]) -> Result<(), crate::sandbox::SandboxError> {
        crate::sandbox::check_env(env, &self.env)
    }

    /// How its programs are confined (`None`: unconfined, the host's own user).
    pub fn confinement(&self) -> Option<&crate::sandbox::Confinement> {
        self.confinement.as_deref()
    }

    /// Every granted program's absolute path (what the sandbox binds when it is not under `/usr`).
    pub fn resolved_programs(&self) -> Vec<PathBuf> {
        let mut programs: Vec<PathBuf> = self.programs.values().cloned().collect();
        programs.sort();
        programs.dedup();
        programs
    }

    /// The absolute path of a granted program, asked for by its granted name or path.
    pub fn program(&self, asked: &str) -> Result<PathBuf, PolicyError> {
        self.programs.get(asked).cloned().ok_or_else(|| PolicyError::ProgramDenied(asked.to_owned()))
    }

    pub(crate) fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Check and translate one argument (or env value): every path in it — at
    /// its start or after `=`, `,` or `:` — must be in the data dir (written
    /// `/data/...` by the guest, rewritten to the host path) or a granted path.
    pub(crate) fn translate(&self, arg: &str) -> Result<String, PolicyError> {
        // No `..` anywhere, so relative paths (resolved in the data dir, the
        // child's working directory) cannot climb out either.
        if arg.split(['/', ',', '=', ':']).any(|part| part == "..") {
            return Err(PolicyError::PathDenied(arg.to_owned()));
        }
        let mut out = String::with_capacity(arg.len());
        let mut rest = arg;
        let mut at_boundary = true;
        while let Some(c) = rest.chars().next() {
            if c == '/' && at_boundary {
                let end = rest.find(',').unwrap_or(rest.len());
                out.push_str(&self.translate_path(&rest[..end])?);
                rest = &rest[end..];
                at_boundary = false;
                continue;
            }
            at_boundary = matches!(c, '=' | ',' | ':');
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        Ok(out)
    }

    fn translate_path(&self, path: &str) -> Result<String, PolicyError> {
        let denied = || PolicyError::PathDenied(path.to_owned());
        let as_path = Path::new(path);
        if !is_clean_absolute(as_path) {
            return Err(denied());
        }
        if let Ok(inside) = as_path.strip_prefix(GUEST_DATA_DIR) {
            return Ok(self.data_dir.join(inside).display().to_string());
        }
        if self.paths.iter().any(|granted| as_path.starts_with(granted)) {
            return Ok(path.to_owned());
        }
        Err(denied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> ProcessPolicy {
        ProcessPolicy::resolve(
            &["sh".into(), "/bin/true".into()],
            &[PathBuf::from("/var/lib/images"), PathBuf::from("/dev/null")],
            Path::new("/srv/broker/providers/kvm"),
        )
        .unwrap()
    }

    #[test]
    fn programs_resolve_to_absolute_paths_and_others_are_denied() {
        let p = policy();
        assert!(p.program("sh").unwrap().is_absolute());
        assert_eq!(p.program("/bin/true").unwrap(), Path::new("/bin/true"));
        assert_eq!(p.program("bash"), Err(PolicyError::ProgramDenied("bash".into())));
        assert!(matches!(
            ProcessPolicy::resolve(&["no-such-program-here".into()], &[], Path::new("/d")),
            Err(PolicyError::ProgramNotFound(_))
        ));
        assert!(matches!(
            ProcessPolicy::resolve(&["/bin/../bin/sh".into()], &[], Path::new("/d")),
            Err(PolicyError::BadGrantedPath(_))
        ));
    }

    #[test]
    fn a_simulated_policy_grants_by_name_and_confines_paths_the_same() {
        let images = PathBuf::from("/var/lib/images");
        let p = ProcessPolicy::unresolved(&["no-such-program-here".into()], &[images], Path::new("/d")).unwrap();
        assert_eq!(p.program("no-such-program-here").unwrap(), Path::new("no-such-program-here"));
        assert_eq!(p.program("sh"), Err(PolicyError::ProgramDenied("sh".into())));
        assert!(p.translate("/var/lib/images/base.img").is_ok());
        assert_eq!(p.translate("/etc/shadow"), Err(PolicyError::PathDenied("/etc/shadow".into())));
        assert!(matches!(
            ProcessPolicy::unresolved(&[], &[PathBuf::from("relative")], Path::new("/d")),
            Err(PolicyError::BadGrantedPath(_))
        ));
    }

    #[test]
    fn argument_paths_are_confined_and_data_paths_translated() {
        let p = policy();
        assert_eq!(p.translate("-nographic").unwrap(), "-nographic");
        assert_eq!(p.translate("/data/disk.qcow2").unwrap(), "/srv/broker/providers/kvm/disk.qcow2");
        assert_eq!(
            p.translate("file=/data/seed.iso,if=virtio").unwrap(),
            "file=/srv/broker/providers/kvm/seed.iso,if=virtio"
        );
        assert_eq!(
            p.translate("backing_file=/var/lib/images/base.img").unwrap(),
            "backing_file=/var/lib/images/base.img"
        );
        assert_eq!(p.translate("unix:/data/qmp.sock").unwrap(), "unix:/srv/broker/providers/kvm/qmp.sock");
        assert_eq!(p.translate("/etc/shadow"), Err(PolicyError::PathDenied("/etc/shadow".into())));
        assert!(p.translate("file=/data/../../etc/passwd").is_err());
        assert!(p.translate("/var/lib/images-evil/x").is_err(), "prefix match is by path component");
        assert_eq!(p.translate("a/b").unwrap(), "a/b", "relative paths stay relative to the data dir (the cwd)");
        assert!(p.translate("../../etc/passwd").is_err());
        assert!(p.translate("file=../x").is_err());
    }
}
