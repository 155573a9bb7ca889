//! What the runtime's CNI network configurations say about us: which files
//! it reads, and whether a network's plugin chain hands its pods to
//! konnectivity-cni, pointed at which agent socket. install-cni writes our
//! entry by these rules; the node agent reads them back to tell the pods of
//! its own network from everything else on the machine.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// Our plugin's `type` in configuration files.
pub const PLUGIN_TYPE: &str = "konnectivity-cni";

/// The network configuration files in `conf_dir`, in the order the runtime
/// considers them (kubelet and containerd use the lexically first): every
/// `.conflist`, `.conf` and `.json` that is not hidden (our own temporary
/// and saved files are hidden, so no runtime reads them).
pub fn config_files(conf_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(conf_dir)?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            let hidden = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'));
            let ext = path.extension().and_then(|e| e.to_str());
            !hidden && matches!(ext, Some("conflist" | "conf" | "json"))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// The agent socket that a network configuration's konnectivity-cni entry
/// hands pods to, or `None` when its chain has no such entry. `config` is a
/// conflist as the runtime reads it from disk or as libcni cached it for an
/// attachment. An entry without `agentSocket` means the plugin's default,
/// as the plugin itself reads it.
pub fn chained_agent_socket(config: &Value) -> Option<PathBuf> {
    let entry = config
        .get("plugins")?
        .as_array()?
        .iter()
        .find(|plugin| plugin["type"] == PLUGIN_TYPE)?;
    Some(PathBuf::from(
        entry["agentSocket"]
            .as_str()
            .unwrap_or(konnectivity_cni::config::DEFAULT_AGENT_SOCKET),
    ))
}

/// The names of the networks configured in `conf_dir` whose chain hands
/// pods to the agent listening on `agent_socket`. Files that cannot be read
/// or parsed name no network: they are the runtime's to judge, not ours.
pub fn networks_chaining(conf_dir: &Path, agent_socket: &Path) -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    for path in config_files(conf_dir)? {
        let Some(config) = std::fs::read(&path)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        else {
            continue;
        };
        if chained_agent_socket(&config).is_some_and(|socket| socket == agent_socket)
            && let Some(name) = config["name"].as_str()
            && !names.iter().any(|known| known == name)
        {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_chain_names_the_socket_of_its_konnectivity_entry() {
        let chained = |entry: Value| json!({"name": "podnet", "plugins": [{"type": "bridge"}, entry]});
        assert_eq!(
            chained_agent_socket(&chained(
                json!({"type": "konnectivity-cni", "agentSocket": "/run/k/cni.sock"})
            )),
            Some(PathBuf::from("/run/k/cni.sock"))
        );
        // The plugin's own default when the entry does not say.
        assert_eq!(
            chained_agent_socket(&chained(json!({"type": "konnectivity-cni"}))),
            Some(PathBuf::from(konnectivity_cni::config::DEFAULT_AGENT_SOCKET))
        );
        assert_eq!(chained_agent_socket(&chained(json!({"type": "portmap"}))), None);
        // A lone plugin configuration cannot chain us.
        assert_eq!(
            chained_agent_socket(&json!({"name": "podnet", "type": "konnectivity-cni"})),
            None
        );
    }

    #[test]
    fn only_networks_chaining_this_agents_socket_are_named() {
        let dir = std::env::temp_dir().join(format!("konn-networks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |file: &str, name: &str, socket: Option<&str>| {
            let mut plugins = vec![json!({"type": "ptp"})];
            if let Some(socket) = socket {
                plugins.push(json!({"type": "konnectivity-cni", "agentSocket": socket}));
            }
            std::fs::write(
                dir.join(file),
                json!({"cniVersion": "1.0.0", "name": name, "plugins": plugins}).to_string(),
            )
            .unwrap();
        };
        write("10-ours.conflist", "ours", Some("/run/a/cni.sock"));
        // Another agent's network (another test run's, another cluster's).
        write("20-theirs.conflist", "theirs", Some("/run/b/cni.sock"));
        write("30-plain.conflist", "plain", None);
        // Our own saved and temporary files are hidden from the runtime.
        write(".40-hidden.conflist", "hidden", Some("/run/a/cni.sock"));
        std::fs::write(dir.join("50-broken.conflist"), "{").unwrap();
        let found = networks_chaining(&dir, Path::new("/run/a//cni.sock"));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found.unwrap(), ["ours"]);
    }
}
