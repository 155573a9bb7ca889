//! The CNI_* environment the runtime sets for every call.

use std::collections::BTreeMap;

use crate::error::{CniError, code};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Status,
    Gc,
}

/// The environment of one call, validated for its command.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniEnv {
    pub container_id: String,
    pub netns: Option<String>,
    pub ifname: String,
    /// `CNI_ARGS` as key/value pairs (Kubernetes adds K8S_POD_NAMESPACE, K8S_POD_NAME).
    pub args: BTreeMap<String, String>,
}

fn missing(var: &str, command: &str) -> CniError {
    CniError::new(
        code::INVALID_ENVIRONMENT,
        format!("{var} must be set for {command}"),
    )
}

/// Reads the command and the variables it needs from `vars`.
pub fn parse<'a>(vars: impl Fn(&str) -> Option<&'a str>) -> Result<(Command, CniEnv), CniError> {
    let name = vars("CNI_COMMAND").ok_or_else(|| {
        CniError::new(
            code::INVALID_ENVIRONMENT,
            "CNI_COMMAND must be set (ADD, DEL, CHECK, VERSION, STATUS, GC)",
        )
    })?;
    let command = match name {
        "ADD" => Command::Add,
        "DEL" => Command::Del,
        "CHECK" => Command::Check,
        "VERSION" => Command::Version,
        "STATUS" => Command::Status,
        "GC" => Command::Gc,
        other => {
            return Err(CniError::new(
                code::INVALID_ENVIRONMENT,
                format!("CNI_COMMAND {other:?} is not a CNI command"),
            ));
        }
    };
    let mut env = CniEnv::default();
    if matches!(command, Command::Add | Command::Del | Command::Check) {
        env.container_id = vars("CNI_CONTAINERID")
            .filter(|v| !v.is_empty())
            .ok_or_else(|| missing("CNI_CONTAINERID", name))?
            .to_owned();
        env.ifname = vars("CNI_IFNAME")
            .filter(|v| !v.is_empty())
            .ok_or_else(|| missing("CNI_IFNAME", name))?
            .to_owned();
        env.netns = vars("CNI_NETNS").filter(|v| !v.is_empty()).map(str::to_owned);
        // DEL may come after the namespace is gone; ADD and CHECK need it.
        if env.netns.is_none() && command != Command::Del {
            return Err(missing("CNI_NETNS", name));
        }
        env.args = parse_args(vars("CNI_ARGS").unwrap_or_default())?;
    }
    Ok((command, env))
}

/// `K=V;K=V`, as CNI_ARGS carries them.
fn parse_args(text: &str) -> Result<BTreeMap<String, String>, CniError> {
    text.split(';')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            pair.split_once('=')
                .filter(|(key, _)| !key.is_empty())
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .ok_or_else(|| {
                    CniError::new(
                        code::INVALID_ENVIRONMENT,
                        format!("CNI_ARGS entry {pair:?} is not KEY=VALUE"),
                    )
                })
        })
        .collect()
}
