//! Installing the plugin on a node: the binary into the CNI bin directory
//! and our entry into the network configuration the runtime uses, both
//! written atomically (temporary file + rename) and idempotently.
//!
//! Kubelet and containerd use the lexically first configuration file in the
//! directory, so that is the one we extend; a lone `.conf` is wrapped into a
//! `.conflist`, its original bytes kept beside it (a hidden file no runtime
//! reads) so that uninstalling restores it exactly. A primary CNI that
//! rewrites its file drops our entry; running the install again (or
//! `--watch`) puts it back.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ArgAction;
use konnectivity_plumbing::flags::{GoList, parse_bool, parse_duration, parse_list};
use serde_json::{Value, json};

use crate::cni::network::{PLUGIN_TYPE, config_files};

/// `proxy-agent install-cni`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct InstallCniArgs {
    /// Where CNI plugin binaries live.
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: std::path::PathBuf,
    /// Where the runtime reads network configurations.
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: std::path::PathBuf,
    /// The plugin binary to install (default: konnectivity-cni next to this binary).
    #[arg(long)]
    pub plugin_binary: Option<std::path::PathBuf>,
    /// The agent's --cni-socket, written into the plugin's configuration; the
    /// two must name the same socket (a bare --cni-socket means this default).
    #[arg(long, default_value = konnectivity_cni::config::DEFAULT_AGENT_SOCKET)]
    pub agent_socket: String,
    /// Namespaces whose pods are not captured, comma-separated.
    #[arg(long, value_parser = parse_list, default_value = "")]
    pub exclude_namespaces: GoList,
    /// Remove the plugin and its configuration entry instead.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub uninstall: bool,
    /// Re-check this often and put the entry back if the primary CNI rewrote
    /// its file (0 = install once and exit).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub watch: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("no CNI network configuration (.conflist, .conf, .json) in {0} yet")]
    NoConfig(String),
    #[error("{path} is not a valid CNI configuration: {reason}")]
    BadConfig { path: String, reason: String },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What an install run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The file already had our entry as configured.
    Unchanged(PathBuf),
    /// The file was written (entry added or updated, or a .conf wrapped).
    Written(PathBuf),
}

/// Our entry in a conflist.
pub fn entry(agent_socket: &str, exclude_namespaces: &[String]) -> Value {
    json!({
        "type": PLUGIN_TYPE,
        "agentSocket": agent_socket,
        "excludeNamespaces": exclude_namespaces,
    })
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), InstallError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let temporary = path.with_file_name(format!(".{name}.konnectivity-tmp"));
    std::fs::write(&temporary, bytes).map_err(io_error(&temporary))?;
    std::fs::rename(&temporary, path).map_err(io_error(path))
}

/// Copies the plugin binary into `bin_dir` as `konnectivity-cni`, atomically.
pub fn install_binary(plugin: &Path, bin_dir: &Path) -> Result<PathBuf, InstallError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin_dir).map_err(io_error(bin_dir))?;
    let target = bin_dir.join(PLUGIN_TYPE);
    let temporary = bin_dir.join(format!(".{PLUGIN_TYPE}.tmp"));
    std::fs::copy(plugin, &temporary).map_err(io_error(plugin))?;
    std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o755))
        .map_err(io_error(&temporary))?;
    std::fs::rename(&temporary, &target).map_err(io_error(&target))?;
    Ok(target)
}

/// The configuration file the runtime uses: the lexically first one.
fn primary_config(conf_dir: &Path) -> Result<PathBuf, InstallError> {
    config_files(conf_dir)
        .map_err(io_error(conf_dir))?
        .into_iter()
        .next()
        .ok_or_else(|| InstallError::NoConfig(conf_dir.display().to_string()))
}

/// Adds (or updates) our entry at the end of the primary configuration's
/// plugin chain, leaving everything else as it was.
pub fn install_config(conf_dir: &Path, ours: &Value) -> Result<Outcome, InstallError> {
    let path = primary_config(conf_dir)?;
    let text = std::fs::read(&path).map_err(io_error(&path))?;
    let bad = |reason: &str| InstallError::BadConfig {
        path: path.display().to_string(),
        reason: reason.to_owned(),
    };
    let mut config: Value = serde_json::from_slice(&text).map_err(|e| bad(&e.to_string()))?;
    let is_list = config.get("plugins").is_some();
    if !is_list {
        // A lone plugin: wrap it into a conflist so we can chain after it.
        let Value::Object(mut single) = config else {
            return Err(bad("not a JSON object"));
        };
        let version = single.remove("cniVersion").unwrap_or(json!("1.0.0"));
        let name = single.remove("name").ok_or_else(|| bad("no \"name\""))?;
        config = json!({ "cniVersion": version, "name": name, "plugins": [Value::Object(single)] });
    }
    let plugins = config
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| bad("\"plugins\" is not a list"))?;
    let present = plugins.iter().position(|p| p["type"] == PLUGIN_TYPE);
    if is_list && present.is_some_and(|i| i == plugins.len() - 1 && plugins[i] == *ours) {
        return Ok(Outcome::Unchanged(path));
    }
    if let Some(i) = present {
        plugins.remove(i);
    }
    plugins.push(ours.clone());
    let mut bytes = serde_json::to_vec_pretty(&config).expect("JSON values serialize");
    bytes.push(b'\n');
    if is_list {
        write_atomically(&path, &bytes)?;
        Ok(Outcome::Written(path))
    } else {
        let list = path.with_extension("conflist");
        write_atomically(&original_of(&list), &text)?;
        write_atomically(&list, &bytes)?;
        std::fs::remove_file(&path).map_err(io_error(&path))?;
        Ok(Outcome::Written(list))
    }
}

/// Where the original of a `.conf` we wrapped into `list` is kept.
fn original_of(list: &Path) -> PathBuf {
    let name = list.with_extension("conf");
    let name = name.file_name().and_then(|n| n.to_str()).unwrap_or("config.conf");
    list.with_file_name(format!(".{name}.konnectivity-original"))
}

/// Removes our entry from the primary configuration (a `.conf` we wrapped
/// comes back byte for byte) and our binary.
pub fn uninstall(conf_dir: &Path, bin_dir: &Path) -> Result<(), InstallError> {
    let primary = primary_config(conf_dir).ok();
    let wrapped = primary.as_ref().map(|path| path.with_extension("conflist"));
    if let (Some(primary), Some(list)) = (&primary, &wrapped)
        && let original = original_of(list)
        && let Ok(bytes) = std::fs::read(&original)
    {
        // Our .conflist is the primary: the original comes back. Or the
        // primary CNI wrote its .conf again since: ours is stale, and goes.
        if primary == list {
            write_atomically(&list.with_extension("conf"), &bytes)?;
        }
        std::fs::remove_file(list).map_err(io_error(list))?;
        std::fs::remove_file(&original).map_err(io_error(&original))?;
    } else if let Some(path) = primary {
        let text = std::fs::read(&path).map_err(io_error(&path))?;
        if let Ok(mut config) = serde_json::from_slice::<Value>(&text)
            && let Some(plugins) = config.get_mut("plugins").and_then(Value::as_array_mut)
            && plugins.iter().any(|p| p["type"] == PLUGIN_TYPE)
        {
            plugins.retain(|p| p["type"] != PLUGIN_TYPE);
            let mut bytes = serde_json::to_vec_pretty(&config).expect("JSON values serialize");
            bytes.push(b'\n');
            write_atomically(&path, &bytes)?;
        }
    }
    match std::fs::remove_file(bin_dir.join(PLUGIN_TYPE)) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(io_error(bin_dir)(error)),
        _ => Ok(()),
    }
}

/// `proxy-agent install-cni`: install (or uninstall) once, or keep the
/// installation in place when `watch` is non-zero.
pub fn run(args: &InstallCniArgs) -> Result<(), InstallError> {
    if args.uninstall {
        uninstall(&args.cni_conf_dir, &args.cni_bin_dir)?;
        tracing::info!(conf_dir = %args.cni_conf_dir.display(), "konnectivity-cni uninstalled");
        return Ok(());
    }
    let plugin = match &args.plugin_binary {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .map_err(io_error(Path::new("/proc/self/exe")))?
            .with_file_name(PLUGIN_TYPE),
    };
    let target = install_binary(&plugin, &args.cni_bin_dir)?;
    tracing::info!(binary = %target.display(), "konnectivity-cni installed");
    let ours = entry(&args.agent_socket, &args.exclude_namespaces.0);
    loop {
        match install_config(&args.cni_conf_dir, &ours) {
            Ok(Outcome::Written(path)) => {
                tracing::info!(config = %path.display(), "chained konnectivity-cni")
            }
            Ok(Outcome::Unchanged(_)) => {}
            // While the primary CNI has not written its file yet, keep waiting.
            Err(InstallError::NoConfig(dir)) if !args.watch.is_zero() => {
                tracing::info!(%dir, "waiting for the primary CNI configuration")
            }
            Err(error) => return Err(error),
        }
        if args.watch.is_zero() {
            return Ok(());
        }
        std::thread::sleep(args.watch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            let path = std::env::temp_dir().join(format!("konn-install-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A conflist as flannel ships it.
    const FLANNEL: &str = r#"{
  "name": "cbr0",
  "cniVersion": "0.3.1",
  "plugins": [
    { "type": "flannel", "delegate": { "hairpinMode": true, "isDefaultGateway": true } },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}"#;

    fn ours() -> Value {
        entry("/var/run/konnectivity/cni.sock", &["kube-system".to_owned()])
    }

    #[test]
    fn appends_our_entry_once_and_leaves_the_rest_alone() {
        let dir = Dir::new("append");
        std::fs::write(dir.0.join("10-flannel.conflist"), FLANNEL).unwrap();
        std::fs::write(dir.0.join("99-other.conflist"), FLANNEL).unwrap();
        let path = dir.0.join("10-flannel.conflist");
        assert_eq!(
            install_config(&dir.0, &ours()).unwrap(),
            Outcome::Written(path.clone())
        );

        let before: Value = serde_json::from_str(FLANNEL).unwrap();
        let after: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let plugins = after["plugins"].as_array().unwrap();
        assert_eq!(plugins.len(), 3);
        assert_eq!(plugins[..2], before["plugins"].as_array().unwrap()[..]);
        assert_eq!(plugins[2], ours());
        for key in ["name", "cniVersion"] {
            assert_eq!(after[key], before[key]);
        }
        // Keys keep their order: the file still reads like the original.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.find("\"name\"").unwrap() < text.find("\"cniVersion\"").unwrap());
        // The other file is untouched.
        assert_eq!(
            std::fs::read_to_string(dir.0.join("99-other.conflist")).unwrap(),
            FLANNEL
        );

        let written = std::fs::read(&path).unwrap();
        assert_eq!(
            install_config(&dir.0, &ours()).unwrap(),
            Outcome::Unchanged(path.clone())
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            written,
            "a second run must change nothing"
        );
    }

    #[test]
    fn puts_the_entry_back_when_the_primary_cni_rewrites_its_file() {
        let dir = Dir::new("rewrite");
        let path = dir.0.join("10-flannel.conflist");
        std::fs::write(&path, FLANNEL).unwrap();
        install_config(&dir.0, &ours()).unwrap();
        std::fs::write(&path, FLANNEL).unwrap();
        assert_eq!(
            install_config(&dir.0, &ours()).unwrap(),
            Outcome::Written(path.clone())
        );
        let after: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(after["plugins"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn wraps_a_lone_conf_into_a_conflist() {
        let dir = Dir::new("wrap");
        std::fs::write(
            dir.0.join("10-bridge.conf"),
            r#"{"cniVersion":"1.0.0","name":"podnet","type":"bridge","bridge":"cni0","ipam":{"type":"host-local"}}"#,
        )
        .unwrap();
        let list = dir.0.join("10-bridge.conflist");
        assert_eq!(
            install_config(&dir.0, &ours()).unwrap(),
            Outcome::Written(list.clone())
        );
        assert!(!dir.0.join("10-bridge.conf").exists());
        let after: Value = serde_json::from_slice(&std::fs::read(&list).unwrap()).unwrap();
        assert_eq!(after["name"], "podnet");
        assert_eq!(after["plugins"][0]["type"], "bridge");
        assert_eq!(after["plugins"][1], ours());
        assert_eq!(install_config(&dir.0, &ours()).unwrap(), Outcome::Unchanged(list));
    }

    #[test]
    fn uninstall_restores_a_wrapped_conf_byte_for_byte() {
        let dir = Dir::new("unwrap");
        let bin_dir = Dir::new("unwrap-bin");
        // Keys in no sorted order, with the file's own spacing.
        let original = "{\n  \"type\": \"bridge\",\n  \"name\": \"podnet\",\n  \"cniVersion\": \"0.4.0\",\n  \"ipam\": {\"type\": \"host-local\"}\n}\n";
        let conf = dir.0.join("10-bridge.conf");
        std::fs::write(&conf, original).unwrap();
        install_config(&dir.0, &ours()).unwrap();
        assert!(!conf.exists());
        uninstall(&dir.0, &bin_dir.0).unwrap();
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), original);
        let left: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["10-bridge.conf"], "nothing of ours is left behind");

        // The primary CNI rewrote its .conf after the wrap: that one stays.
        install_config(&dir.0, &ours()).unwrap();
        let rewritten = "{\"cniVersion\": \"1.0.0\", \"name\": \"podnet\", \"type\": \"bridge\"}\n";
        std::fs::write(&conf, rewritten).unwrap();
        uninstall(&dir.0, &bin_dir.0).unwrap();
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), rewritten);
        let left: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["10-bridge.conf"], "the stale wrap is gone");
    }

    #[test]
    fn empty_directories_and_broken_files_are_clear_errors() {
        let dir = Dir::new("errors");
        assert!(matches!(
            install_config(&dir.0, &ours()),
            Err(InstallError::NoConfig(_))
        ));
        std::fs::write(dir.0.join("10-x.conflist"), "{broken").unwrap();
        let error = install_config(&dir.0, &ours()).unwrap_err();
        assert!(error.to_string().contains("10-x.conflist"), "{error}");
    }

    #[test]
    fn binary_install_is_atomic_and_executable_and_uninstall_removes_everything() {
        use std::os::unix::fs::PermissionsExt;
        let dir = Dir::new("binary");
        let plugin = dir.0.join("build-output");
        std::fs::write(&plugin, b"#!/bin/true\n").unwrap();
        let bin_dir = dir.0.join("bin");
        let target = install_binary(&plugin, &bin_dir).unwrap();
        assert_eq!(
            std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o755
        );
        assert_eq!(
            std::fs::read_dir(&bin_dir).unwrap().count(),
            1,
            "no temporary file left"
        );

        let conf_dir = dir.0.join("net.d");
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::write(conf_dir.join("10-flannel.conflist"), FLANNEL).unwrap();
        install_config(&conf_dir, &ours()).unwrap();
        uninstall(&conf_dir, &bin_dir).unwrap();
        assert!(!target.exists());
        let after: Value =
            serde_json::from_slice(&std::fs::read(conf_dir.join("10-flannel.conflist")).unwrap()).unwrap();
        assert_eq!(after, serde_json::from_str::<Value>(FLANNEL).unwrap());
    }
}
