use std::io::{Read, Write};

fn main() {
    let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
    let mut stdin = Vec::new();
    // A read error leaves stdin empty, which the config check reports.
    let _ = std::io::stdin().take(1024 * 1024).read_to_end(&mut stdin);
    let outcome = konnectivity_cni::plugin::run(
        |name| vars.get(name).map(String::as_str),
        &stdin,
        // The runtime runs plugins in the host's network namespace.
        std::path::Path::new("/proc/self/ns/net"),
    );
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(outcome.stdout.as_bytes());
    let _ = stdout.flush();
    std::process::exit(outcome.exit_code);
}
