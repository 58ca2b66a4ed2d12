//! `broker provider new NAME`: a provider crate, outside any workspace, that
//! builds as written and passes `broker provider test --strict`.

use super::UsageError;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Where the SDK comes from in the crate written.
pub(crate) enum SdkSource {
    /// A directory holding the SDK crate.
    Path(PathBuf),
    /// A git repository holding it (cargo finds the crate in it by name), at a revision if given.
    Git { url: String, rev: Option<String> },
}

impl SdkSource {
    /// The SDK this `broker` was built beside, if it is still there.
    pub(crate) fn built_beside() -> Option<SdkSource> {
        let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guests/sdk");
        sdk.join("Cargo.toml").is_file().then(|| SdkSource::Path(std::path::absolute(&sdk).unwrap_or(sdk)))
    }

    /// The dependency's TOML inline table.
    fn dependency(&self) -> String {
        let quoted = |text: &str| toml::Value::String(text.to_owned()).to_string();
        match self {
            SdkSource::Path(path) => format!("{{ path = {} }}", quoted(&path.display().to_string())),
            SdkSource::Git { url, rev: None } => format!("{{ git = {} }}", quoted(url)),
            SdkSource::Git { url, rev: Some(rev) } => format!("{{ git = {}, rev = {} }}", quoted(url), quoted(rev)),
        }
    }
}

/// The files written, path (relative to the crate) and template.
const FILES: [(&str, &str); 7] = [
    ("Cargo.toml", include_str!("template/Cargo.toml.in")),
    (".cargo/config.toml", include_str!("template/config.toml.in")),
    ("src/lib.rs", include_str!("template/lib.rs.in")),
    ("provider.toml", include_str!("template/provider.toml.in")),
    ("provider.script.json", include_str!("template/provider.script.json.in")),
    ("README.md", include_str!("template/README.md.in")),
    (".gitignore", include_str!("template/gitignore.in")),
];

/// Write the crate of provider `name` into `dir`, which must not exist or be
/// empty; the paths written, in order.
pub(crate) fn write(name: &str, dir: &Path, sdk: &SdkSource) -> Result<Vec<PathBuf>> {
    // The argument itself, before it names a directory or fills a template;
    // a crate's name also begins with a letter.
    let valid = broker_core::manifest::is_provider_name(name) && name.starts_with(|c: char| c.is_ascii_lowercase());
    if !valid {
        let why = format!("provider name {name:?} must be 1-63 lowercase letters, digits and '-', a letter first");
        return Err(UsageError(why).into());
    }
    let fill = |template: &str| {
        template
            .replace("{{name}}", name)
            .replace("{{crate}}", &name.replace('-', "_"))
            .replace("{{sdk}}", &sdk.dependency())
    };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Looked at once it exists, whichever way the path went there.
    let mut entries = std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    if entries.next().is_some() {
        return Err(UsageError(format!("{} exists and is not empty", dir.display())).into());
    }
    let mut written = Vec::new();
    for (relative, template) in FILES {
        let path = dir.join(relative);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        // Never over a file, whatever appeared meanwhile.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        std::io::Write::write_all(&mut file, fill(template).as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crate_is_written_whole_with_its_name_and_sdk_and_never_over_another() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("static-pool");
        let sdk = SdkSource::Git { url: "https://example.test/wasm-broker".into(), rev: Some("v0.3.0".into()) };
        let written = write("static-pool", &target, &sdk).unwrap();
        assert_eq!(written.len(), FILES.len());
        let read = |path: &str| std::fs::read_to_string(target.join(path)).unwrap();
        let cargo: toml::Table = read("Cargo.toml").parse().unwrap();
        assert_eq!(cargo["package"]["name"].as_str(), Some("static-pool"));
        assert_eq!(cargo["dependencies"]["broker-guest"]["rev"].as_str(), Some("v0.3.0"));
        assert!(read("provider.toml").contains("release/static_pool.wasm"));
        assert!(read(".cargo/config.toml").contains("-zstack-size=65536"));
        assert!(!read("src/lib.rs").contains("{{"), "every placeholder filled");

        let again = write("static-pool", &target, &sdk).unwrap_err();
        assert!(again.to_string().contains("exists and is not empty"), "{again}");
        for bad in ["Bad", "9lives", "a_b", "", "x\" #/../../victim", &"a".repeat(64)] {
            let refused = write(bad, &dir.path().join("x"), &sdk).unwrap_err();
            assert!(refused.downcast_ref::<UsageError>().is_some(), "{bad}: {refused}");
        }
        assert!(!dir.path().join("x").exists(), "nothing written for a refused name");
    }
}
