//! The workspace's crates as `cargo metadata` describes them: their
//! targets, their dependencies, and the names their sources use.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Dependencies whose name no source can carry, and why.
const NAMED_ELSEWHERE: &[(&str, &str, &str)] = &[
    // The generated gRPC code (build.rs writes it into OUT_DIR and
    // lib.rs includes it) names these.
    (
        "konnectivity-proto",
        "tonic_prost",
        "the generated gRPC code names it",
    ),
];

pub struct Workspace {
    pub crates: Vec<Crate>,
}

pub struct Crate {
    pub name: String,
    pub targets: Vec<Target>,
    dependencies: Vec<Dependency>,
}

pub struct Target {
    pub name: String,
    pub root: PathBuf,
    kind: TargetKind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum TargetKind {
    /// lib, bin, proc-macro.
    Product,
    /// test, bench, example.
    Development,
    Build,
}

struct Dependency {
    /// The name its crate is known by in the sources (`webpki` for
    /// rustls-webpki, or a rename).
    lib: String,
    package: String,
    kind: TargetKind,
    /// Whether it is a member of this workspace.
    local: bool,
}

impl Workspace {
    pub fn load() -> Workspace {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let output = std::process::Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--offline", "--locked"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("cargo metadata runs");
        assert!(
            output.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
        let members: BTreeSet<&str> = metadata["workspace_members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_str().unwrap())
            .collect();
        let packages = metadata["packages"].as_array().unwrap();
        // A package's library name, for each package name (the resolved
        // graph may hold two versions of one package: same library name).
        let lib_names: BTreeMap<&str, String> = packages
            .iter()
            .filter_map(|package| {
                let lib = package["targets"].as_array()?.iter().find(|target| {
                    target["kind"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k == "lib" || k == "proc-macro" || k == "rlib")
                })?;
                Some((package["name"].as_str()?, lib["name"].as_str()?.replace('-', "_")))
            })
            .collect();
        let member_names: BTreeSet<&str> = packages
            .iter()
            .filter(|p| members.contains(p["id"].as_str().unwrap()))
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        let mut crates = Vec::new();
        for package in packages {
            if !members.contains(package["id"].as_str().unwrap()) {
                continue;
            }
            let targets = package["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|target| {
                    let kinds: Vec<&str> = target["kind"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|k| k.as_str().unwrap())
                        .collect();
                    let kind = if kinds.contains(&"custom-build") {
                        TargetKind::Build
                    } else if kinds.iter().any(|k| matches!(*k, "test" | "bench" | "example")) {
                        TargetKind::Development
                    } else {
                        TargetKind::Product
                    };
                    Target {
                        name: target["name"].as_str().unwrap().to_owned(),
                        root: PathBuf::from(target["src_path"].as_str().unwrap()),
                        kind,
                    }
                })
                .collect();
            let dependencies = package["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .map(|dependency| {
                    let name = dependency["name"].as_str().unwrap();
                    let lib = match dependency["rename"].as_str() {
                        Some(rename) => rename.replace('-', "_"),
                        None => lib_names
                            .get(name)
                            .cloned()
                            .unwrap_or_else(|| name.replace('-', "_")),
                    };
                    let kind = match dependency["kind"].as_str() {
                        Some("dev") => TargetKind::Development,
                        Some("build") => TargetKind::Build,
                        _ => TargetKind::Product,
                    };
                    Dependency {
                        lib,
                        package: name.to_owned(),
                        kind,
                        local: member_names.contains(name),
                    }
                })
                .collect();
            crates.push(Crate {
                name: package["name"].as_str().unwrap().to_owned(),
                targets,
                dependencies,
            });
        }
        crates.sort_by(|a, b| a.name.cmp(&b.name));
        Workspace { crates }
    }

    /// One line per crate: its lines of Rust and the workspace crates it
    /// depends on.
    pub fn describe(&self) -> String {
        let mut text = String::new();
        let mut total = 0;
        for krate in &self.crates {
            let lines = krate.lines();
            total += lines;
            let deps: Vec<String> = krate.workspace_deps(false).into_iter().collect();
            text.push_str(&format!(
                "{:<22} {:>6} lines  -> {}\n",
                krate.name,
                lines,
                deps.join(", ")
            ));
        }
        text.push_str(&format!("{:<22} {total:>6} lines\n", "total"));
        text
    }
}

impl Crate {
    /// The workspace crates this one depends on; with `development`, its
    /// tests' and benchmarks' too.
    pub fn workspace_deps(&self, development: bool) -> BTreeSet<String> {
        self.dependencies
            .iter()
            .filter(|d| d.local && (development || d.kind != TargetKind::Development))
            .map(|d| d.package.clone())
            .collect()
    }

    /// Dependencies whose name none of the sources that may use them
    /// carries.
    pub fn unused_dependencies(&self) -> Vec<String> {
        let mut names: BTreeMap<TargetKind, BTreeSet<String>> = BTreeMap::new();
        for target in &self.targets {
            let names = names.entry(target.kind).or_default();
            for file in files_of(&target.root) {
                let text = std::fs::read_to_string(&file).unwrap();
                let tokens: proc_macro2::TokenStream = text
                    .parse()
                    .unwrap_or_else(|e| panic!("{}: {e:?}", file.display()));
                idents(tokens, names);
            }
        }
        let empty = BTreeSet::new();
        let named_in = |kind: TargetKind, lib: &str| names.get(&kind).unwrap_or(&empty).contains(lib);
        self.dependencies
            .iter()
            .filter(|d| {
                let named = match d.kind {
                    TargetKind::Product => named_in(TargetKind::Product, &d.lib),
                    // A development dependency serves tests, and unit tests
                    // live in the library's own files.
                    TargetKind::Development => {
                        named_in(TargetKind::Development, &d.lib) || named_in(TargetKind::Product, &d.lib)
                    }
                    TargetKind::Build => named_in(TargetKind::Build, &d.lib),
                };
                let excused = NAMED_ELSEWHERE
                    .iter()
                    .any(|(krate, lib, _)| *krate == self.name && *lib == d.lib);
                !named && !excused
            })
            .map(|d| format!("{} ({})", d.package, d.lib))
            .collect()
    }

    fn lines(&self) -> usize {
        let mut files = BTreeSet::new();
        for target in &self.targets {
            files.extend(files_of(&target.root));
        }
        files
            .iter()
            .map(|file| std::fs::read_to_string(file).unwrap().lines().count())
            .sum()
    }
}

impl PartialOrd for TargetKind {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TargetKind {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (*self as u8).cmp(&(*other as u8))
    }
}

/// Every Rust file of the target whose root is `root`: the files its `mod`
/// declarations reach.
fn files_of(root: &Path) -> BTreeSet<PathBuf> {
    let tree = super::modules::ModuleTree::read(root);
    let base = root.parent().unwrap();
    tree.file_graph().keys().map(|file| base.join(file)).collect()
}

fn idents(tokens: proc_macro2::TokenStream, names: &mut BTreeSet<String>) {
    for token in tokens {
        match token {
            proc_macro2::TokenTree::Ident(ident) => {
                names.insert(ident.to_string());
            }
            proc_macro2::TokenTree::Group(group) => idents(group.stream(), names),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dependency no source names is reported; one named in code, in a
    /// macro's arguments or only by a test (a development dependency) is
    /// not.
    #[test]
    fn the_dependency_check_reports_what_no_source_names() {
        let dir = std::env::temp_dir().join(format!("konnectivity-layout-deps-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tests")).unwrap();
        std::fs::write(
            dir.join("lib.rs"),
            "//! serde_json is named only in this comment.\nfn f() { tokio::spawn(async {}); tracing::info!(x = ?bytes::Bytes::new()); }\n",
        )
        .unwrap();
        std::fs::write(dir.join("tests/it.rs"), "use rcgen::KeyPair;\n").unwrap();
        let dependency = |lib: &str, kind| Dependency {
            lib: lib.to_owned(),
            package: lib.replace('_', "-"),
            kind,
            local: false,
        };
        let krate = Crate {
            name: "scratch".to_owned(),
            targets: vec![
                Target {
                    name: "scratch".to_owned(),
                    root: dir.join("lib.rs"),
                    kind: TargetKind::Product,
                },
                Target {
                    name: "it".to_owned(),
                    root: dir.join("tests/it.rs"),
                    kind: TargetKind::Development,
                },
            ],
            dependencies: vec![
                dependency("tokio", TargetKind::Product),
                dependency("tracing", TargetKind::Product),
                dependency("bytes", TargetKind::Product),
                dependency("serde_json", TargetKind::Product),
                dependency("rcgen", TargetKind::Development),
                dependency("rcgen", TargetKind::Product),
            ],
        };
        assert_eq!(
            krate.unused_dependencies(),
            ["serde-json (serde_json)", "rcgen (rcgen)"],
            "a library may not lean on what only its tests name"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
