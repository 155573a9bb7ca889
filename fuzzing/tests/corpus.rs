//! Every committed corpus input of every fuzz target, through the same
//! checks the fuzzer applies: what a fuzzing run once found stays fixed, and
//! the targets' code keeps compiling and passing on the stable toolchain.

use std::path::PathBuf;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

#[test]
fn committed_seeds_are_current() {
    let update = std::env::var_os("UPDATE_SEEDS").is_some();
    for (target, name, bytes) in konnectivity_fuzzing::seeds::seeds() {
        let path = corpus_dir(target).join(format!("seed-{name}"));
        if update {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_SEEDS=1 writes it)", path.display()));
        assert_eq!(
            committed,
            bytes,
            "{} is stale (UPDATE_SEEDS=1 rewrites it)",
            path.display()
        );
    }
}

#[test]
fn every_corpus_input_passes_its_target() {
    for (target, check) in konnectivity_fuzzing::TARGETS {
        let dir = corpus_dir(target);
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{target} has no corpus");
        for input in inputs {
            let bytes = std::fs::read(&input).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&bytes));
            assert!(outcome.is_ok(), "{target} fails on {}", input.display());
        }
    }
}
