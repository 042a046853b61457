//! What the binary's end-to-end tests share: the program, one run of it, documents as files.

use std::process::Command;

/// The program under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowprefill"))
}

/// One run: success, stdout, stderr.
pub fn run(args: &[&str]) -> (bool, String, String) {
    let out = bin().args(args).output().expect("run flowprefill");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Documents as files in a fresh folder (named by `tag` and the process), and their `--doc`
/// arguments.
pub fn write_docs(tag: &str, docs: &[&str]) -> (std::path::PathBuf, Vec<String>) {
    let dir = std::env::temp_dir().join(format!("fp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        let p = dir.join(format!("d{i}.txt"));
        std::fs::write(&p, d).unwrap();
        args.push("--doc".to_string());
        args.push(p.to_string_lossy().into_owned());
    }
    (dir, args)
}
