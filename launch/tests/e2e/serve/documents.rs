//! `POST /v1/documents`, jobs naming documents by `document_ids`, and the store's damaged
//! files as the service counts them (a module of the `serve` tests: its server and helpers).

use super::*;

/// `POST /v1/documents` prefills documents into the service's store and answers their ids and
/// token counts (a second time: nothing prefilled); a job naming them by `document_ids` reads
/// their caches from the store and answers as the same job sending the texts; an unknown id is
/// a 400 naming it; without a store, ingestion is a 409 saying what to give.
#[test]
fn documents_are_ingested_once_and_jobs_name_them_by_id() {
    let dir = std::env::temp_dir().join(format!("fp-serve-docs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = dir.join("store");
    let s = Server::start(&["--store", store.to_str().unwrap()], &[]);
    let d = docs(3, 5);
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": d }));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    let got = v["documents"].as_array().unwrap();
    assert_eq!(got.len(), 3, "{v}");
    assert!(got.iter().all(|x| x["tokens"].as_u64().unwrap() > 20 && x["prefilled"] == 2), "{v}");
    let ids: Vec<serde_json::Value> = got.iter().map(|x| x["id"].clone()).collect();
    let again = json(&s.post("/v1/documents", &serde_json::json!({ "documents": d })));
    assert!(again["documents"].as_array().unwrap().iter().all(|x| x["prefilled"] == 0), "{again}");
    assert_eq!(again["documents"].as_array().unwrap().iter().map(|x| x["id"].clone()).collect::<Vec<_>>(), ids);

    let by_text = json(&s.post("/v1/jobs", &job(&d)));
    let mut body = job(&d);
    body.as_object_mut().unwrap().remove("documents");
    body["document_ids"] = ids.clone().into();
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let by_id = json(&r);
    assert_eq!(by_id["answer"], by_text["answer"], "{by_id}");
    assert!(by_id["answer"].as_str().unwrap().contains("4729"), "{by_id}");
    assert_eq!(by_id["cache_misses"], 0, "{by_id}");

    body["document_ids"] = serde_json::json!([ids[0], "00000000deadbeef"]);
    let r = s.post("/v1/jobs", &body);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("document_ids") && r.text().contains("`00000000deadbeef`"), "{}", r.text());
    body["documents"] = serde_json::json!(d);
    let r = s.post("/v1/jobs", &body);
    assert!(r.status == 400 && r.text().contains("one of"), "{}", r.text());
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": [] }));
    assert_eq!(r.status, 400, "{}", r.text());
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": ["fine", "  "] }));
    assert!(r.status == 400 && r.text().contains("documents[1]"), "{}", r.text());
    let m = s.metrics();
    // Four 400s (two jobs, two ingestions), each counted once.
    assert!(m.contains("flowprefill_errors_total{kind=\"bad_request\"} 4"), "{m}");
    assert!(m.contains("flowprefill_documents_ingested_total{outcome=\"prefilled\"} 3"), "{m}");
    assert!(m.contains("flowprefill_documents_ingested_total{outcome=\"held\"} 3"), "{m}");
    // The store emptied under the service (`store clear`, a trim by another process): the same
    // documents are prefilled again, not answered as stored from the ingester's memory.
    let (files, _) = flowprefill_worker::store::disk::clear(&store).unwrap();
    assert!(files >= 6, "two forms of three documents: {files}");
    let after = json(&s.post("/v1/documents", &serde_json::json!({ "documents": d })));
    assert!(after["documents"].as_array().unwrap().iter().all(|x| x["prefilled"] == 2), "{after}");
    // An ingestion that fails part way names what it stored before the failure, and those stay.
    let fresh = "The lighthouse keeper logs the tide at 0600 every morning.";
    let too_long = "word ".repeat(12_000);
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": [fresh, too_long] }));
    assert!(r.status >= 400 && r.text().contains("documents[1]"), "{}", r.text());
    assert!(r.text().contains("the documents before it are stored (ids "), "{}", r.text());
    let again = json(&s.post("/v1/documents", &serde_json::json!({ "documents": [fresh] })));
    assert_eq!(again["documents"][0]["prefilled"], 0, "{again}");
    assert!(r.text().contains(again["documents"][0]["id"].as_str().unwrap()), "{}", r.text());
    drop(s);

    let off = Server::start(&["--store", "off"], &[]);
    let r = off.post("/v1/documents", &serde_json::json!({ "documents": d }));
    assert!(r.status == 409 && r.text().contains("--store FOLDER"), "{}", r.text());
    assert!(off.metrics().contains("flowprefill_errors_total{kind=\"no_store\"} 1"), "counted once");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ingests four documents into a store in `tag`'s folder, then damages every cache file in its
/// middle (its checksum no longer matches): the folder, the store, the documents and the count
/// of damaged files.
fn damaged_store(tag: &str) -> (std::path::PathBuf, String, Vec<String>, usize) {
    let dir = std::env::temp_dir().join(format!("fp-serve-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = dir.join("store").to_str().unwrap().to_string();
    let d = docs(4, 5);
    let s = Server::start(&["--store", &store], &[]);
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": d }));
    assert_eq!(r.status, 200, "{}", r.text());
    drop(s);
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(&store)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().and_then(|x| x.to_str()) == Some("fpkv"))
        .collect();
    assert!(files.len() >= 8, "two forms of four documents: {files:?}");
    for f in &files {
        let mut bytes = std::fs::read(f).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(f, bytes).unwrap();
    }
    (dir, store, d, files.len())
}

/// The damaged-entries counter of `/metrics`, and the job's ranks' reports of them.
fn corrupt_counts(metrics: &str, v: &serde_json::Value) -> (u64, Vec<u64>) {
    let corrupt = metrics
        .lines()
        .find_map(|l| l.strip_prefix("flowprefill_store_corrupt_total ").and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no corrupt counter:\n{metrics}"));
    let per_rank =
        v["rank_stats"].as_array().unwrap().iter().map(|r| r["disk_corrupt"].as_u64().unwrap_or(0)).collect();
    (corrupt, per_rank)
}

/// A damaged file of the disk tier is dropped and counted once: two thread ranks share their
/// process's store, and the job's ranks report its new faults once between them (an MPI world's
/// processes each report their own: `under_mpirun_damaged_store_files_are_counted_on_both_ranks`).
#[test]
fn damaged_store_files_are_counted_once() {
    let (dir, store, d, files) = damaged_store("corrupt");
    let s = Server::start(&["--store", &store, "--ranks", "2"], &[]);
    let v = json(&s.post("/v1/jobs", &job(&d)));
    // Each of the four documents' caches was read from disk, found damaged and prefilled again,
    // on whichever rank holds it: each file dropped is counted once (no more than there were).
    assert_eq!((v["ranks"].as_u64(), v["cache_hits"].as_u64()), (Some(2), Some(0)), "{v}");
    let (corrupt, per_rank) = corrupt_counts(&s.metrics(), &v);
    assert_eq!(corrupt, per_rank.iter().sum::<u64>(), "{per_rank:?}");
    assert!(corrupt >= 4 && corrupt <= files as u64, "{corrupt} of {files} files");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Under mpirun each process has its own view of the store: the follower's damaged files are
/// counted too (the service showed rank 0's alone).
#[cfg(feature = "mpi")]
#[test]
fn under_mpirun_damaged_store_files_are_counted_on_both_ranks() {
    let (dir, store, d, _) = damaged_store("corrupt-mpi");
    let (mut child, addr) = mpirun_serve(&[], &["--store", &store, "--comm-timeout", "20"]);
    let body = job(&d).to_string();
    let r = http::request(&addr, "POST", "/v1/jobs", &[], body.as_bytes(), Duration::from_secs(120)).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    let m = http::request(&addr, "GET", "/metrics", &[], b"", Duration::from_secs(10)).unwrap();
    let (corrupt, per_rank) = corrupt_counts(&m.text(), &v);
    assert!(per_rank.len() == 2 && per_rank.iter().all(|&c| c > 0), "both processes dropped files: {per_rank:?}");
    assert_eq!(corrupt, per_rank.iter().sum::<u64>(), "{per_rank:?}");
    Command::new("kill").args(["-USR1", &child.id().to_string()]).status().unwrap();
    assert!(exit_within(&mut child, Duration::from_secs(60)).success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ingestions wait like jobs (one runs, `--queue` wait, the next gets 429 with Retry-After),
/// and a client that goes away stops its own between layers (counted as cancelled, nothing
/// counted as ingested); the documents of the finished ones are stored.
#[test]
fn ingestions_are_bounded_and_a_client_that_goes_away_cancels_its_own() {
    let dir = std::env::temp_dir().join(format!("fp-serve-ingest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let s = Server::start(&["--queue", "1", "--store", dir.join("store").to_str().unwrap()], &[]);
    // Long documents (about 3,000 tokens each, every one new to the store).
    let long = |tag: &str| -> String { docs(1, 160).remove(0).replace("tower 0", &format!("tower {tag}")) };
    let post = |addr: String, doc: String| {
        std::thread::spawn(move || {
            let body = serde_json::json!({ "documents": [doc] }).to_string();
            http::request(&addr, "POST", "/v1/documents", &[], body.as_bytes(), Duration::from_secs(300)).unwrap()
        })
    };
    let a = post(s.addr.clone(), long("a"));
    std::thread::sleep(Duration::from_millis(300));
    let b = post(s.addr.clone(), long("b"));
    std::thread::sleep(Duration::from_millis(300));
    let body = serde_json::json!({ "documents": [long("c")] }).to_string();
    let r = s.req("POST", "/v1/documents", &[], body.as_bytes());
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some_and(|v| v.parse::<u64>().is_ok()));
    assert!(r.text().contains("--queue"), "{}", r.text());
    // Both held the device's queue as the third was refused (the first still prefilling its
    // 3,000 tokens, unless it finished in the moment since).
    let m = s.metrics();
    let held = |n: u32| m.contains(&format!("flowprefill_ingestions_in_flight {n}\n"));
    assert!(held(2) || held(1), "{m}");
    assert_eq!(a.join().unwrap().status, 200);
    assert_eq!(b.join().unwrap().status, 200);
    let t = Instant::now();
    while !s.metrics().contains("flowprefill_ingestions_in_flight 0\n") {
        assert!(t.elapsed() < Duration::from_secs(10), "the gauge went back to 0:\n{}", s.metrics());
        std::thread::sleep(Duration::from_millis(100));
    }

    // A client that sends a document and goes away: its ingestion stops.
    let payload = serde_json::json!({ "documents": [long("d")] }).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/documents HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(c);
    let t = Instant::now();
    let m = loop {
        let m = s.metrics();
        if m.contains("flowprefill_errors_total{kind=\"cancelled\"} 1") {
            break m;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the cancelled ingestion was not recorded:\n{m}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(m.contains("flowprefill_documents_ingested_total{outcome=\"prefilled\"} 2"), "{m}");
    // The service carries on: the next ingestion runs.
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": docs(1, 5) }));
    assert_eq!(r.status, 200, "{}", r.text());
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPU lost while a document is ingested: 503 naming the document, the service exits 69, and
/// nothing of that ingestion is written to the store (the head's cache was made before the
/// fault; read back from a lost GPU it could not be trusted).
#[test]
fn a_gpu_lost_during_an_ingestion_writes_nothing_and_the_service_exits_69() {
    let dir = std::env::temp_dir().join(format!("fp-serve-ingest-lost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = dir.join("store");
    let mut s = Server::start(
        &["--store", store.to_str().unwrap()],
        &[("FLOWPREFILL_FAULT", "rank:0,phase:ingest,mode:device-lost")],
    );
    let r = s.post("/v1/documents", &serde_json::json!({ "documents": docs(2, 5) }));
    assert_eq!(r.status, 503, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["error"]["kind"], "device_failure", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.starts_with("documents[0]: ") && msg.contains("an injected fault at rank 0's ingest"), "{msg}");
    let (code, err) = s.wait_code();
    assert_eq!(code, Some(69), "{err}");
    let written: Vec<_> = std::fs::read_dir(&store)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "fpkv")).collect())
        .unwrap_or_default();
    assert!(written.is_empty(), "caches from a lost GPU were written: {written:?}");
    let _ = std::fs::remove_dir_all(dir);
}
