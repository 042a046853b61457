//! Prometheus' metric lint (`promtool check metrics`, client_golang's `promlint`) over the text
//! exposition format, written here so that the tests need no `promtool`: the structure a
//! scraper needs (HELP and TYPE once per family and before its samples, a family's samples
//! together, no series twice, parseable labels and values) and the naming rules (HELP present;
//! counters end in `_total` and nothing else does; base units; no unit abbreviations, camelCase,
//! colons, type names in the name; `_bucket`, `_count`, `_sum`, `le` and `quantile` only where
//! histograms and summaries put them; and, stricter than promlint, `percent` where Prometheus'
//! naming guide asks for a ratio, a histogram without its `+Inf` bucket, a negative counter).
//! Used by the tests that scrape `/metrics` (`serve.rs` and its modules).

use std::collections::{BTreeMap, BTreeSet};

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// What a family declared and held.
#[derive(Default)]
struct Family {
    help: bool,
    kind: Option<String>,
    samples: Vec<Sample>,
}

/// The problems of an exposition, each `<metric> <what>` as promtool prints them (empty: clean).
pub fn lint(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    // Families in the order they appear; one that comes back after another is split.
    let mut order: Vec<String> = Vec::new();
    let mut seen_series = BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        let at = |msg: &str| format!("line {}: {msg}: {line:?}", i + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let mut words = rest.trim_start().splitn(3, ' ');
            let (keyword, name) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            if keyword != "HELP" && keyword != "TYPE" {
                continue;
            }
            if !valid_metric_name(name) {
                problems.push(at("invalid metric name"));
                continue;
            }
            enter(&mut order, name, &mut problems, &at);
            let f = families.entry(name.to_string()).or_default();
            if keyword == "HELP" {
                if f.help {
                    problems.push(at("second HELP line"));
                }
                f.help = true;
            } else {
                let kind = words.next().unwrap_or("").trim();
                if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                    problems.push(at("unknown metric type"));
                }
                if f.kind.is_some() {
                    problems.push(at("second TYPE line"));
                }
                if !f.samples.is_empty() {
                    problems.push(at("TYPE after the family's samples"));
                }
                f.kind = Some(kind.to_string());
            }
            continue;
        }
        let Some(sample) = parse_sample(line) else {
            problems.push(at("malformed sample"));
            continue;
        };
        let family = family_of(&sample.name, &families);
        enter(&mut order, &family, &mut problems, &at);
        let mut key = sample.labels.clone();
        key.sort();
        if !seen_series.insert((sample.name.clone(), key)) {
            problems.push(format!("{family} metric not unique"));
        }
        families.entry(family).or_default().samples.push(sample);
    }
    for (name, f) in &families {
        lint_family(name, f, &mut problems);
    }
    problems
}

/// Every sample of an exposition (lines that do not parse are left out: [`lint`] names them).
pub fn samples(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).filter_map(parse_sample).collect()
}

/// Notes that `family` is being read; a family that comes back after another is split.
fn enter(order: &mut Vec<String>, family: &str, problems: &mut Vec<String>, at: &dyn Fn(&str) -> String) {
    if order.last().is_some_and(|l| l == family) {
        return;
    }
    if order.iter().any(|o| o == family) {
        problems.push(at(&format!("the samples of {family} are not together")));
    }
    order.push(family.to_string());
}

/// The family a sample belongs to: `x_bucket`, `x_sum`, `x_count` to a histogram or summary
/// `x` declared before it, anything else to its own name.
fn family_of(name: &str, families: &BTreeMap<String, Family>) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            let kind = families.get(base).and_then(|f| f.kind.as_deref());
            if kind == Some("histogram") || (kind == Some("summary") && suffix != "_bucket") {
                return base.to_string();
            }
        }
    }
    name.to_string()
}

fn lint_family(name: &str, f: &Family, problems: &mut Vec<String>) {
    let mut say = |msg: &str| problems.push(format!("{name} {msg}"));
    let kind = f.kind.as_deref().unwrap_or("untyped");
    if !f.help {
        say("no help text");
    }
    // Counters.
    match (kind == "counter", name.ends_with("_total")) {
        (true, false) => say("counter metrics should have \"_total\" suffix"),
        (false, true) => say("non-counter metrics should not have \"_total\" suffix"),
        _ => {}
    }
    // Reserved suffixes and labels of histograms and summaries.
    if kind != "histogram" && name.ends_with("_bucket") {
        say("non-histogram metrics should not have \"_bucket\" suffix");
    }
    for suffix in ["_count", "_sum"] {
        if kind != "histogram" && kind != "summary" && name.ends_with(suffix) {
            say(&format!("non-histogram and non-summary metrics should not have \"{suffix}\" suffix"));
        }
    }
    let labels: BTreeSet<&str> = f.samples.iter().flat_map(|s| s.labels.iter().map(|(k, _)| k.as_str())).collect();
    if kind != "histogram" && labels.contains("le") {
        say("non-histogram metrics should not have \"le\" label");
    }
    if kind != "summary" && labels.contains("quantile") {
        say("non-summary metrics should not have \"quantile\" label");
    }
    if kind == "histogram" && !f.samples.iter().any(|s| s.name.ends_with("_bucket") && le(s) == Some(f64::INFINITY)) {
        say("histogram without a +Inf bucket");
    }
    // The type in the name.
    if kind != "untyped" {
        for t in ["counter", "gauge", "histogram", "summary", "gaugehistogram"] {
            if name.contains(&format!("_{t}_")) || name.ends_with(&format!("_{t}")) {
                say(&format!("metric name should not include type '{t}'"));
            }
        }
    }
    // Spelling.
    if name.contains(':') {
        say("metric names should not contain ':'");
    }
    if camel(name) {
        say("metric names should be written in 'snake_case' not 'camelCase'");
    }
    if labels.iter().any(|l| camel(l)) {
        say("label names should be written in 'snake_case' not 'camelCase'");
    }
    const ABBREVIATIONS: [&str; 14] = ["s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d"];
    if name.split('_').any(|w| ABBREVIATIONS.contains(&w)) {
        say("metric names should not contain abbreviated units");
    }
    if let Some((unit, base)) = unit_of(name) {
        if unit != base {
            say(&format!("use base unit \"{base}\" instead of \"{unit}\""));
        }
    }
    // Values a counter cannot take.
    if kind == "counter" && f.samples.iter().any(|s| s.value.is_nan() || s.value < 0.0) {
        say("counter with a negative or NaN value");
    }
}

/// The first unit word of a metric name and its base unit (`microseconds`: `seconds`).
fn unit_of(name: &str) -> Option<(String, &'static str)> {
    const UNITS: [(&str, &str); 27] = [
        ("amperes", "amperes"),
        ("bytes", "bytes"),
        ("celsius", "celsius"),
        ("grams", "grams"),
        ("joules", "joules"),
        ("kelvin", "kelvin"),
        ("meters", "meters"),
        ("metres", "metres"),
        ("seconds", "seconds"),
        ("volts", "volts"),
        ("minutes", "seconds"),
        ("hours", "seconds"),
        ("days", "seconds"),
        ("weeks", "seconds"),
        ("kelvins", "kelvin"),
        ("fahrenheit", "celsius"),
        ("rankine", "celsius"),
        ("inches", "meters"),
        ("yards", "meters"),
        ("miles", "meters"),
        ("bits", "bytes"),
        ("calories", "joules"),
        ("pounds", "grams"),
        ("ounces", "grams"),
        ("percent", "ratio"),
        ("percents", "ratio"),
        ("ratio", "ratio"),
    ];
    const PREFIXES: [&str; 14] = [
        "pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kila", "mega", "giga", "tera",
        "peta",
    ];
    let base = |w: &str| UNITS.iter().find(|(u, _)| *u == w).map(|(_, b)| *b);
    name.split('_').find_map(|w| {
        base(w).or_else(|| PREFIXES.iter().find_map(|p| w.strip_prefix(p).and_then(base))).map(|b| (w.to_string(), b))
    })
}

/// A lower-case letter followed by an upper-case one.
fn camel(s: &str) -> bool {
    s.as_bytes().windows(2).any(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase())
}

fn le(s: &Sample) -> Option<f64> {
    s.labels.iter().find(|(k, _)| k == "le").and_then(|(_, v)| v.parse().ok())
}

fn valid_metric_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

fn valid_label_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_') && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

/// `name{label="value",...} value [timestamp]`, label values with `\\`, `\"` and `\n` escaped.
fn parse_sample(line: &str) -> Option<Sample> {
    let end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = &line[..end];
    if !valid_metric_name(name) {
        return None;
    }
    let mut rest = &line[end..];
    let mut labels = Vec::new();
    if let Some(mut r) = rest.strip_prefix('{') {
        loop {
            r = r.trim_start();
            if let Some(after) = r.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = r.find('=')?;
            let label = r[..eq].trim();
            if !valid_label_name(label) || labels.iter().any(|(k, _)| k == label) {
                return None;
            }
            let mut chars = r[eq + 1..].trim_start().strip_prefix('"')?.char_indices();
            let mut value = String::new();
            let close = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        'n' => value.push('\n'),
                        _ => return None,
                    },
                    (_, '\n') => return None,
                    (_, c) => value.push(c),
                }
            };
            labels.push((label.to_string(), value));
            r = &r[eq + 1..].trim_start()[1 + close + 1..];
            r = r.trim_start();
            if let Some(after) = r.strip_prefix(',') {
                r = after;
            } else if !r.starts_with('}') {
                return None;
            }
        }
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next()?.parse::<f64>().ok()?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().ok()?;
    }
    if fields.next().is_some() || !rest.starts_with(' ') {
        return None;
    }
    Some(Sample { name: name.to_string(), labels, value })
}

/// The lint fails on what promtool flagged in the service's `/metrics` before its counters of
/// time were in seconds, and on a counter without `_total`.
#[test]
fn promlint_flags_microseconds_and_a_counter_without_total() {
    let old = "# HELP flowprefill_op_microseconds_total Microseconds of model work per op family and rank\n\
               # TYPE flowprefill_op_microseconds_total counter\n\
               flowprefill_op_microseconds_total{op=\"matmul\",rank=\"0\"} 2302760\n\
               flowprefill_op_microseconds_total{op=\"attention\",rank=\"1\"} 1083433\n\
               \n\
               # HELP flowprefill_chunk_cache_hits Chunk-store hits\n\
               # TYPE flowprefill_chunk_cache_hits counter\n\
               flowprefill_chunk_cache_hits 3\n";
    assert_eq!(
        lint(old),
        [
            "flowprefill_chunk_cache_hits counter metrics should have \"_total\" suffix",
            "flowprefill_op_microseconds_total use base unit \"seconds\" instead of \"microseconds\"",
        ]
    );
}

/// The other rules, each caught once; a clean exposition with a histogram, a summary and
/// escaped label values has no problem.
#[test]
fn promlint_rules_and_a_clean_exposition() {
    let bad = "# TYPE x_jobs_total gauge\n\
               x_jobs_total 1\n\
               # HELP x_latency_ms Latency\n\
               # TYPE x_latency_ms histogram\n\
               x_latency_ms_bucket{le=\"1\"} 2\n\
               # HELP x_queueDepth Depth\n\
               # TYPE x_queueDepth gauge\n\
               x_queueDepth{le=\"3\"} 2\n\
               # HELP x_size_gauge Size\n\
               # TYPE x_size_gauge gauge\n\
               x_size_gauge 1\n\
               # HELP x_read_bytes_total Bytes\n\
               # TYPE x_read_bytes_total counter\n\
               x_read_bytes_total{rank=\"0\"} 1\n\
               x_read_bytes_total{rank=\"0\"} 2\n\
               x_size_gauge{rank=\"1\"} 2\n\
               x_broken{rank=\"0} 1\n";
    let got = lint(bad);
    for want in [
        "x_jobs_total no help text",
        "x_jobs_total non-counter metrics should not have \"_total\" suffix",
        "x_latency_ms metric names should not contain abbreviated units",
        "x_latency_ms histogram without a +Inf bucket",
        "x_queueDepth metric names should be written in 'snake_case' not 'camelCase'",
        "x_queueDepth non-histogram metrics should not have \"le\" label",
        "x_size_gauge metric name should not include type 'gauge'",
        "x_read_bytes_total metric not unique",
        "the samples of x_size_gauge are not together",
        "malformed sample",
    ] {
        assert_eq!(got.iter().filter(|p| p.contains(want)).count(), 1, "{want:?} in {got:#?}");
    }
    assert_eq!(got.len(), 10, "{got:#?}");

    let clean = "# HELP x_wait_seconds_total Seconds waited\n\
                 # TYPE x_wait_seconds_total counter\n\
                 x_wait_seconds_total{op=\"a\\\"b\\\\c\\nd\",rank=\"1\"} 0.25\n\
                 x_wait_seconds_total{op=\"matmul\",rank=\"0\"} 1e-7\n\
                 \n\
                 # HELP x_ttft_seconds Time to first token\n\
                 # TYPE x_ttft_seconds histogram\n\
                 x_ttft_seconds_bucket{method=\"infoflow\",le=\"0.5\"} 1\n\
                 x_ttft_seconds_bucket{method=\"infoflow\",le=\"+Inf\"} 2\n\
                 x_ttft_seconds_sum{method=\"infoflow\"} 1.5\n\
                 x_ttft_seconds_count{method=\"infoflow\"} 2\n\
                 # HELP x_rpc_duration_seconds RPC time\n\
                 # TYPE x_rpc_duration_seconds summary\n\
                 x_rpc_duration_seconds{quantile=\"0.5\"} 0.1\n\
                 x_rpc_duration_seconds_sum 3\n\
                 x_rpc_duration_seconds_count 9 1700000000000\n";
    assert_eq!(lint(clean), Vec::<String>::new());
    let s = samples(clean);
    assert_eq!(s.len(), 9);
    assert_eq!(s[0].labels, [("op".to_string(), "a\"b\\c\nd".to_string()), ("rank".into(), "1".into())]);
    assert_eq!(s[1].value, 1e-7);
}
