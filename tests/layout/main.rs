//! The workspace's layout, checked (style.md 13: a crate is a concern with
//! a name, depends only on what it uses, and no two modules import each
//! other in a circle).
//!
//! Reads the crate graph from `cargo metadata` and every crate's modules
//! with `syn`, then fails on:
//! - a circle between workspace crates, development dependencies included
//!   (cargo refuses circles of normal dependencies, not through tests);
//! - a dependency a crate's sources never name;
//! - a circle between modules: module A names an item of module B (a `use`,
//!   a path in code or in a macro's arguments) and B, directly or through
//!   others, names one of A's. A parent that only declares a child (`mod
//!   child;`) does not depend on it; a parent that uses or re-exports the
//!   child's items does, and then the child must not reach back into the
//!   parent's file: what both need lives in a module of its own.
//!
//! `cargo test -p konnectivity-tests --test layout -- --nocapture` prints
//! the crate graph with each crate's lines.

mod modules;
mod workspace;

use std::collections::{BTreeMap, BTreeSet};

use workspace::Workspace;

#[test]
fn no_two_workspace_crates_depend_on_each_other_in_a_circle() {
    let workspace = Workspace::load();
    let graph: BTreeMap<String, BTreeSet<String>> = workspace
        .crates
        .iter()
        .map(|krate| (krate.name.clone(), krate.workspace_deps(true)))
        .collect();
    let circles = modules::circles(&graph);
    assert!(circles.is_empty(), "crates in a circle: {circles:#?}");
    println!("{}", workspace.describe());
}

/// The layers of docs/architecture.md, lowest first: a crate depends only
/// on crates of lower layers. The test, benchmark and fuzz crates are above
/// them all.
const LAYERS: &[&[&str]] = &[
    &["konnectivity-proto", "konnectivity-plumbing", "konnectivity-cni"],
    &[
        "konnectivity-telemetry",
        "konnectivity-kube",
        "konnectivity-mux",
        "konnectivity-client",
    ],
    &["konnectivity-node"],
    &[
        "konnectivity-server",
        "konnectivity-agent",
        "konnectivity-test-client",
    ],
    &["konnectivity-kube-standin"],
    &["konnectivity-tests", "konnectivity-bench", "konnectivity-fuzzing"],
];

#[test]
fn every_crate_depends_only_on_crates_of_lower_layers() {
    let workspace = Workspace::load();
    let layer = |name: &str| {
        LAYERS
            .iter()
            .position(|layer| layer.contains(&name))
            .unwrap_or_else(|| panic!("{name} is in no layer of LAYERS (and of docs/architecture.md)"))
    };
    let mut upward = Vec::new();
    for krate in &workspace.crates {
        for dependency in krate.workspace_deps(false) {
            if layer(&dependency) >= layer(&krate.name) {
                upward.push(format!("{} -> {dependency}", krate.name));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "dependencies on a crate of the same or a higher layer: {upward:#?}"
    );
}

#[test]
fn every_crate_names_each_of_its_dependencies() {
    let workspace = Workspace::load();
    let mut unused = Vec::new();
    for krate in &workspace.crates {
        for dependency in krate.unused_dependencies() {
            unused.push(format!("{}: {dependency}", krate.name));
        }
    }
    assert!(
        unused.is_empty(),
        "dependencies a crate never names (remove them, or say in workspace.rs why the sources cannot name them): {unused:#?}"
    );
}

#[test]
fn no_two_modules_import_each_other_in_a_circle() {
    let workspace = Workspace::load();
    let mut problems = Vec::new();
    for krate in &workspace.crates {
        for target in &krate.targets {
            let tree = modules::ModuleTree::read(&target.root);
            for circle in modules::circles(&tree.file_graph()) {
                problems.push(format!(
                    "{} ({}): {}",
                    krate.name,
                    target.name,
                    circle.join(" -> ")
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "modules in a circle:\n{}",
        problems.join("\n")
    );
}

/// The checker itself: a circle it must find, and the forms that are none.
#[test]
fn the_module_check_finds_a_circle_through_a_parent_and_not_through_a_declaration() {
    let dir = tempdir();
    let write = |path: &str, text: &str| {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write(
        "lib.rs",
        "mod a;\nmod b;\npub struct Top;\nfn f() { a::run(); }\n#[cfg(test)] mod tests { use super::*; }\n",
    );
    // a reaches back into lib.rs: lib -> a -> lib.
    write("a.rs", "pub fn run() { let _ = crate::Top; }\n");
    // b only names a sibling through its parent, and a macro names a.
    write(
        "b.rs",
        "use super::a;\nfn g() { tracing::info!(x = ?crate::a::run()); a::run(); }\n",
    );
    let tree = modules::ModuleTree::read(&dir.join("lib.rs"));
    let circles = modules::circles(&tree.file_graph());
    assert_eq!(
        circles,
        vec![vec!["a.rs".to_owned(), "lib.rs".to_owned(), "a.rs".to_owned()]]
    );

    // Once Top lives in a module of its own, nothing is in a circle.
    write(
        "lib.rs",
        "mod a;\nmod b;\nmod top;\npub use top::Top;\nfn f() { a::run(); }\n",
    );
    write("top.rs", "pub struct Top;\n");
    write("a.rs", "pub fn run() { let _ = crate::top::Top; }\n");
    let tree = modules::ModuleTree::read(&dir.join("lib.rs"));
    assert!(modules::circles(&tree.file_graph()).is_empty());
    // A path through the re-export resolves to where the item is defined.
    write("a.rs", "pub fn run() { let _ = crate::Top; }\n");
    let tree = modules::ModuleTree::read(&dir.join("lib.rs"));
    assert!(
        modules::circles(&tree.file_graph()).is_empty(),
        "{:?}",
        tree.file_graph()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("konnectivity-layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
