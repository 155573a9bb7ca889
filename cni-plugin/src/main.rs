use std::io::{IsTerminal, Read, Write};

fn main() {
    let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
    let asked_for_help = std::env::args()
        .skip(1)
        .any(|arg| matches!(arg.as_str(), "-h" | "--help" | "help"));
    if asked_for_help {
        print!("{}", konnectivity_cni::USAGE);
        return;
    }
    // A person at a terminal, or a runtime that forgot CNI_COMMAND: say what
    // this is on stderr, and never wait for a configuration nobody will type.
    let by_hand = !vars.contains_key("CNI_COMMAND") || std::io::stdin().is_terminal();
    if by_hand {
        eprint!("{}", konnectivity_cni::USAGE);
    }
    let mut stdin = Vec::new();
    if vars.contains_key("CNI_COMMAND") && !std::io::stdin().is_terminal() {
        // A read error leaves stdin empty, which the config check reports.
        let _ = std::io::stdin().take(1024 * 1024).read_to_end(&mut stdin);
    }
    let mut outcome = konnectivity_cni::plugin::run(
        |name| vars.get(name).map(String::as_str),
        &stdin,
        // The runtime runs plugins in the host's network namespace.
        std::path::Path::new("/proc/self/ns/net"),
    );
    // One JSON document per line, as a shell and a log reader expect.
    if !outcome.stdout.is_empty() && !outcome.stdout.ends_with('\n') {
        outcome.stdout.push('\n');
    }
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(outcome.stdout.as_bytes());
    let _ = stdout.flush();
    std::process::exit(outcome.exit_code);
}
