//! The chunk store's disk tier and ingestion through the binary: a new process reads what the
//! last one stored, a full disk is a warning, `flowprefill ingest` and `run --doc-id`.

use std::process::Command;

use crate::common::{bin, run, write_docs};

/// The chunk store's disk tier (issue 52): a second process answers from the first one's
/// entries, bit for bit (the same answer and selection, every chunk a disk hit, none
/// prefilled); another KV element type never hits them; `--store off` keeps RAM only; the
/// operator's `store stats | ls | verify | gc | clear` see and trim the folder.
#[test]
fn the_disk_tier_serves_a_new_process_bit_for_bit() {
    let (dir, mut args) = write_docs(
        "store-disk",
        &[
            "The ferry to Holmwick leaves from pier nine at dawn and returns before the tide turns.",
            "The code of the Holmwick lighthouse door is 7713. Only the keeper and the mayor know it.",
            "Fishermen of Holmwick dry their nets on the long stone wall by the fish market.",
        ],
    );
    let store = dir.join("store");
    args.splice(0..0, ["run".to_string()]);
    args.extend(
        ["--query", "What is the code of the Holmwick lighthouse door?", "--method", "infoflow", "--ratio", "0.3"]
            .map(String::from),
    );
    args.extend(["--max-tokens", "12", "--json", "--store", store.to_str().unwrap()].map(String::from));
    let json = |extra: &[&str]| -> serde_json::Value {
        let out = bin().args(&args).args(extra).output().expect("run");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let cold = json(&[]);
    let chunks = cold["cache_misses"].as_u64().unwrap();
    assert!(chunks >= 3 && cold["cache_disk_hits"] == 0, "{cold}");
    let warm = json(&[]);
    assert_eq!((warm["cache_misses"].as_u64(), warm["cache_disk_hits"].as_u64()), (Some(0), Some(chunks)), "{warm}");
    // The first token's top logits too: a round trip that changed values (a rounding, a layer
    // dropped) could keep a short greedy answer.
    for k in ["answer", "selected", "order", "n_context_tokens", "first_top_logits"] {
        assert_eq!(warm[k], cold[k], "{k}: a disk hit answers as the cold run");
    }
    assert!(!cold["answer"].as_str().unwrap().trim().is_empty(), "{cold}");
    // Another element type of the cache: another scope, never a hit (and its own entries).
    let bf16 = json(&["--kv-dtype", "bf16"]);
    assert_eq!((bf16["cache_disk_hits"].as_u64(), bf16["cache_misses"].as_u64()), (Some(0), Some(chunks)), "{bf16}");
    let mut off_args = args.clone();
    let at = off_args.iter().position(|a| a == "--store").unwrap();
    off_args[at + 1] = "off".into();
    let out = bin().args(&off_args).output().unwrap();
    let off: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (off["cache_disk_hits"].as_u64(), off["cache_misses"].as_u64()),
        (Some(0), Some(chunks)),
        "--store off: RAM only"
    );
    let st = |cmd: &[&str]| {
        let (ok, out, err) = run(&[&["store"], cmd, &["--store", store.to_str().unwrap()]].concat());
        assert!(ok, "store {cmd:?}: {err}");
        out
    };
    let stats = st(&["stats"]);
    assert!(
        stats.contains(&format!("{} entries", 2 * chunks)) && stats.contains(" f32 v2") && stats.contains(" bf16 v2"),
        "{stats}"
    );
    assert_eq!(st(&["ls"]).lines().count() as u64, 2 * chunks);
    let one = st(&["ls", "--limit", "1"]);
    let more = format!("({} older entries not shown; --limit {} lists every one)", 2 * chunks - 1, 2 * chunks);
    assert!(one.lines().count() == 2 && one.contains(&more), "{one}");
    assert!(st(&["verify"]).contains(&format!("{} intact, 0 damaged", 2 * chunks)));
    assert!(st(&["gc", "--max-gib", "0"]).contains(&format!("deleted {} least recently used", 2 * chunks)));
    assert!(st(&["clear"]).contains("deleted 0 files"));
    let doc = dir.join("d0.txt");
    let (ok, _, err) = run(&["run", "--store", "", "--doc", doc.to_str().unwrap(), "--query", "q"]);
    assert!(!ok && err.contains("--store: give a folder, or off"), "{err}");
    // Without --store (and FLOWPREFILL_STORE, which the test script sets to off), `run` keeps
    // its caches in $FLOWPREFILL_HOME/store.
    let home = dir.join("home");
    let model = flowprefill_worker::fetch::default_model_path().unwrap();
    let mut plain: Vec<String> = args.iter().take_while(|a| *a != "--store").cloned().collect();
    plain.extend(["--model".into(), model.to_string_lossy().into_owned()]);
    let out = bin().args(&plain).env_remove("FLOWPREFILL_STORE").env("FLOWPREFILL_HOME", &home).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(flowprefill_worker::store::disk::list(&home.join("store"), None).unwrap().len() as u64, chunks);
    let _ = std::fs::remove_dir_all(dir);
}

/// A full disk under the store: the job answers, one warning says the entry was not written.
/// Needs root to mount a 64 KiB tmpfs (CI runs as root); elsewhere it says SKIPPED.
#[test]
fn a_full_disk_is_a_warning_and_the_job_answers() {
    let (dir, mut args) =
        write_docs("store-full", &["The key of the Fernhill boathouse hangs on a blue nail.", "Boats."]);
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs", store.to_str().unwrap()])
        .output()
        .is_ok_and(|o| o.status.success());
    if !mounted {
        flowprefill_kernels::testing::skipped(
            "cannot mount a tmpfs (not root)",
            "a_full_disk_is_a_warning_and_the_job_answers",
        );
        let _ = std::fs::remove_dir_all(dir);
        return;
    }
    args.splice(0..0, ["run".to_string()]);
    args.extend(["--query", "Where does the key hang?", "--max-tokens", "8", "--json", "--store"].map(String::from));
    args.push(store.to_string_lossy().into_owned());
    let out = bin().args(&args).output().expect("run");
    let _ = Command::new("umount").arg(&store).status();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("was not written") && err.contains("the job goes on"), "{err}");
    assert_eq!(err.matches("was not written").count(), 1, "one warning: {err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `flowprefill ingest` prefills documents into the store (files, a folder, JSON Lines) once:
/// a second ingestion prefills nothing, a later `run` in a new process over the same documents
/// (by file or by id) is all disk hits and answers exactly as a cold run with no store; an
/// unknown id is an error naming it; ingestion without a store says what to give.
#[test]
fn ingested_documents_are_disk_hits_by_file_and_by_id() {
    let texts = [
        "The night train to Varrow stops at Elm Cross, Dunmere and the harbour halt.",
        "The locker code at Varrow station is 5820. The clerk changes it every spring.",
        "Varrow's harbour halt has a tea room that opens only when the ferry is due.",
    ];
    let (dir, doc_args) = write_docs("store-ingest", &texts);
    let store = dir.join("store");
    let s = store.to_str().unwrap().to_string();
    let ingest = |extra: &[String]| -> serde_json::Value {
        let out = bin().args(["ingest", "--store", &s, "--json"]).args(extra).output().expect("ingest");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let first = ingest(&doc_args);
    let docs = first["documents"].as_array().unwrap();
    assert_eq!(docs.len(), 3, "{first}");
    let ids: Vec<String> = docs.iter().map(|d| d["id"].as_str().unwrap().to_string()).collect();
    for d in docs {
        assert!(d["tokens"].as_u64().unwrap() > 10, "{d}");
        assert_eq!(d["prefilled"], 2, "both forms made (behind the head, alone): {d}");
    }
    // The folder (its files; the store below it and hidden files skipped) and JSON Lines:
    // nothing new.
    std::fs::write(dir.join(".gitkeep"), "").unwrap();
    let again = ingest(&["--dir".to_string(), dir.to_str().unwrap().to_string()]);
    let again_ids: Vec<&str> =
        again["documents"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap()).collect();
    assert_eq!(again_ids, ids.iter().map(String::as_str).collect::<Vec<_>>(), "the same ids: {again}");
    assert!(again["documents"].as_array().unwrap().iter().all(|d| d["prefilled"] == 0), "{again}");
    let jsonl = dir.join("docs.jsonl");
    std::fs::write(&jsonl, format!("{}\n\n{}\n", serde_json::json!(texts[1]), serde_json::json!({ "text": texts[2] })))
        .unwrap();
    let from_jsonl = ingest(&["--jsonl".to_string(), jsonl.to_str().unwrap().to_string()]);
    assert_eq!(from_jsonl["documents"][0]["id"], ids[1].as_str(), "{from_jsonl}");
    assert!(from_jsonl["documents"].as_array().unwrap().iter().all(|d| d["prefilled"] == 0), "{from_jsonl}");
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": 5}\n").unwrap();
    let out = bin().args(["ingest", "--store", &s, "--jsonl", bad.to_str().unwrap()]).output().expect("ingest");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("line 1: an object needs a string field `text`"), "{err}");
    std::fs::remove_file(&bad).unwrap();

    let query = ["--query", "What is the locker code at Varrow station?", "--max-tokens", "16", "--json"];
    let run_json = |docs: &[String], store: &str| -> serde_json::Value {
        let out = bin().arg("run").args(docs).args(query).args(["--store", store]).output().expect("run");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let cold = run_json(&doc_args, "off");
    let by_file = run_json(&doc_args, &s);
    let id_args: Vec<String> = ids.iter().flat_map(|id| ["--doc-id".to_string(), id.clone()]).collect();
    let by_id = run_json(&id_args, &s);
    for warm in [&by_file, &by_id] {
        assert_eq!(warm["cache_misses"], 0, "every cache was ingested: {warm}");
        assert_eq!(warm["cache_disk_hits"], cold["cache_misses"], "{warm}");
        for k in ["answer", "selected", "order", "n_context_tokens", "first_top_logits"] {
            assert_eq!(warm[k], cold[k], "{k}: ingested caches answer as a cold run");
        }
    }
    // Ingested with a system message: a job with the same one finds every cache on disk.
    let system = ["--system", "You answer in one short sentence."];
    let out = bin().args(["ingest", "--store", &s]).args(system).args(&doc_args).output().expect("ingest");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("run --doc-id ID with the same --system"));
    let out = bin().arg("run").args(&id_args).args(query).args(["--store", &s]).args(system).output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["cache_misses"], 0, "the system message's caches were ingested: {v}");
    assert!(cold["answer"].as_str().unwrap().contains("5820"), "{cold}");

    let (ok, stats, err) = run(&["store", "stats", "--store", &s]);
    assert!(ok && stats.contains("ingested documents: 3") && !stats.contains("no cache of theirs"), "{stats}{err}");
    // A document that fails (longer than the model's window) is not left behind as ingested.
    let long = dir.join("long.txt");
    std::fs::write(&long, "The ferry to Varrow leaves at dawn and returns at dusk. ".repeat(1200)).unwrap();
    let out = bin()
        .args(["ingest", "--store", &s, "--doc", &doc_args[1], "--doc", long.to_str().unwrap(), "--doc", &doc_args[5]])
        .output()
        .expect("ingest");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("split it into smaller documents"), "{err}");
    assert!(!err.contains("answer tokens"), "ingestion has no answer to shorten: {err}");
    let (before, after) = (format!("stored before that: {} (", doc_args[1]), format!("not reached: {}", doc_args[5]));
    assert!(err.contains(&before) && err.contains(&after), "says what is in and what is not: {err}");
    let (ok, stats, err) = run(&["store", "stats", "--store", &s]);
    assert!(ok && stats.contains("ingested documents: 3"), "the failed document was kept: {stats}{err}");
    let (ok, _, err) = run(&["run", "--store", &s, "--doc-id", "00000000deadbeef", "--query", "q"]);
    assert!(!ok && err.contains("--doc-id: unknown document id `00000000deadbeef`"), "{err}");
    let (ok, _, err) = run(&["ingest", "--store", "off", "--doc", &doc_args[1]]);
    assert!(!ok && err.contains("--store is off") && err.contains("--store FOLDER"), "{err}");
    let (ok, _, err) = run(&["ingest", "--store", &s]);
    assert!(!ok && err.contains("no documents"), "{err}");
    // A file where the store's folder should be: an error, not "no chunk store there yet".
    let out = bin().args(["store", "stats", "--store", &doc_args[1]]).output().expect("store stats");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("a file, not a folder"), "{err}");

    // `bench ttft --cache disk` under a configured store (FLOWPREFILL_STORE here, as a user who
    // runs `serve` with it exported): its disk tier is a folder of its own inside, and the
    // store's entries are all still there after it.
    let entries = |d: &std::path::Path| {
        std::fs::read_dir(d).unwrap().flatten().filter(|e| e.path().extension().is_some_and(|x| x == "fpkv")).count()
    };
    let held = entries(&store);
    assert!(held >= 6, "two forms of three documents: {held}");
    let bench_out = dir.join("bench");
    let out = bin()
        .env("FLOWPREFILL_STORE", &s)
        .args(["bench", "ttft", "--lengths", "300", "--doc-tokens", "100", "--ranks", "1", "--runs", "1"])
        .args(["--methods", "none", "--cache", "disk", "--out", bench_out.to_str().unwrap()])
        .output()
        .expect("bench ttft");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(entries(&store), held, "the store's entries are left alone");
    assert!(entries(&store.join("bench-ttft")) > 0, "the benchmark's disk tier is its own folder");

    // A budget that cannot hold what ingestion writes: an error that says what to change, not
    // a success over caches deleted as they were written.
    let small = dir.join("small-store");
    let (ok, _, err) = run(&[
        &["ingest", "--store", small.to_str().unwrap(), "--store-gib", "0.0001"][..],
        &["--doc", doc_args[1].as_str()],
    ]
    .concat());
    assert!(!ok && err.contains("were deleted at once") && err.contains("raise --store-gib"), "{err}");
    // A budget that holds one document's caches: a second ingestion of it and another finds the
    // first stored, then the store deletes the oldest files (the head's, the first's) for the
    // second's; the first is not kept any more, and the ingestion says so (it exited 0).
    let tight = dir.join("tight-store");
    let t = tight.to_str().unwrap();
    let (ok, _, err) = run(&["ingest", "--store", t, "--doc", &doc_args[1]]);
    assert!(ok, "{err}");
    let held: u64 = std::fs::read_dir(&tight)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "fpkv"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    let gib = format!("{}", held as f64 * 1.2 / (1u64 << 30) as f64);
    let (ok, out, err) =
        run(&["ingest", "--store", t, "--store-gib", &gib, "--doc", &doc_args[1], "--doc", &doc_args[3]]);
    assert!(!ok && err.contains("not on disk now") && err.contains(&doc_args[1]), "{out}{err}");
    assert!(out.contains("NOT KEPT"), "{out}");

    // A process whose budget is smaller than what the folder holds says what it deleted and
    // which flag keeps it (it was silent: an ingestion under a larger --store-gib, then a run).
    let (ok, _, err) = run(&[
        "run",
        "--store",
        &s,
        "--store-gib",
        "0.000001",
        "--doc-id",
        &ids[0],
        "--query",
        "q",
        "--max-tokens",
        "1",
    ]);
    assert!(ok && err.contains("over this process's budget") && err.contains("--store-gib"), "{err}");

    // `store clear` deletes the caches and says that the ingested texts stay (ids still resolve).
    let (ok, out, err) = run(&["store", "clear", "--store", &s]);
    assert!(ok && out.contains("kept: 3 ingested documents' texts"), "{out}{err}");
    assert_eq!(entries(&store), 0, "every cache deleted");
    let (ok, stats, err) = run(&["store", "stats", "--store", &s]);
    assert!(ok && stats.contains("ingested documents: 3"), "{stats}{err}");
    assert!(stats.contains("no cache of theirs is on disk"), "says their caches are gone: {stats}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench ttft --cache disk` with no store configured and `--out` at `FLOWPREFILL_HOME` keeps its
/// disk tier in a folder of its own (`OUT/bench-store`), not `$FLOWPREFILL_HOME/store`, whose
/// entries survive; and a folder at its place that it did not make is refused, never emptied.
#[test]
fn bench_ttft_on_disk_never_empties_a_folder_it_did_not_make() {
    let home = std::env::temp_dir().join(format!("fp-bench-home-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let store = home.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let entry = store.join("users-entry.fpkv");
    std::fs::write(&entry, b"a user's chunk cache").unwrap();
    let bench = |out: &std::path::Path| {
        bin()
            .env("FLOWPREFILL_HOME", &home)
            .env_remove("FLOWPREFILL_STORE")
            .args(["bench", "ttft", "--lengths", "256", "--doc-tokens", "64", "--ranks", "1", "--methods", "none"])
            .args(["--cache", "cold,disk", "--runs", "1", "--out"])
            .arg(out)
            .output()
            .expect("run flowprefill")
    };
    let o = bench(&home);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(std::fs::read(&entry).unwrap(), b"a user's chunk cache", "the user's entry survives");
    assert!(home.join("bench-store/.flowprefill-bench-ttft").is_file(), "the bench's own folder, marked");
    // Again: its own folder is reused.
    assert!(bench(&home).status.success());
    // A folder at OUT/bench-store that the bench did not make is refused, left as it was.
    let other = home.join("other");
    let theirs = other.join("bench-store/keep.fpkv");
    std::fs::create_dir_all(theirs.parent().unwrap()).unwrap();
    std::fs::write(&theirs, b"keep").unwrap();
    let o = bench(&other);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("did not make"), "{err}");
    assert_eq!(std::fs::read(&theirs).unwrap(), b"keep");
    let _ = std::fs::remove_dir_all(&home);
}
