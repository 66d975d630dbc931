//! The README's Rust quick starts are the examples `readme_cust` and
//! `readme_cudarc`, which CI compiles (`.ci/run`): each README block must be
//! the example's file, so that the README shows code that builds.

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

#[test]
fn readme_rust_blocks_are_the_compiled_examples() {
    let readme = readme();
    for example in ["readme_cust", "readme_cudarc"] {
        let path = format!("{}/examples/{example}.rs", env!("CARGO_MANIFEST_DIR"));
        let code = std::fs::read_to_string(&path).unwrap();
        assert!(
            readme.contains(code.trim_end()),
            "README.md's block differs from examples/{example}.rs"
        );
    }
}

#[test]
fn readme_keeps_the_two_set_up_commands() {
    let readme = readme();
    assert!(readme.contains("cargo run --release -- compare traces/*.trace.gz"));
    assert!(
        readme.contains("cargo test --workspace --release && (cd fuzz && cargo test --release)")
    );
    assert!(readme.lines().count() <= 150, "README.md is a front page");
}
