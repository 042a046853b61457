//! What users write for a method and its budget: the method spec (`NAME[+reorder][@RATIO|~C]`,
//! one grammar for the command line, eval records and the API) and a budget by coverage.

use super::{check_ratio, Method, RunOptions};
use flowprefill_kernels::topk::count_for_ratio;
use flowprefill_worker::{Field, InputError};
use std::str::FromStr;

/// A budget by attention coverage (`--coverage`, issue 53) instead of a fixed ratio: the fewest
/// context tokens whose selection scores reach `share` of the total score mass of the context,
/// at least `min_ratio` and at most `max_ratio` of it. A question whose answer sits in one
/// place recomputes little; one whose attention is spread recomputes more. `share` 1 keeps
/// `max_ratio` of the context (1: every token, full prefill's cache).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Coverage {
    /// Share of the score mass to reach, in (0, 1].
    pub share: f64,
    /// Least fraction of the context recomputed (`--min-ratio`, default 0).
    #[serde(default)]
    pub min_ratio: f64,
    /// Largest fraction of the context recomputed (`--max-ratio`, default 1).
    #[serde(default = "one")]
    pub max_ratio: f64,
}

fn one() -> f64 {
    1.0
}

impl Coverage {
    /// `share` between ratios 0 and 1.
    pub fn new(share: f64) -> Self {
        Self { share, min_ratio: 0.0, max_ratio: 1.0 }
    }

    /// The budget by coverage a request asks for, with the bounds it gives: the share given on
    /// its own (`--coverage`, `coverage`) or, failing that, the method's (`infoflow~0.9`). Bounds
    /// with no share anywhere say what is missing (they would bound nothing). A share given both
    /// ways is compared by [`MethodSpec::merge`].
    pub fn requested(
        share: Option<f64>,
        spec: Option<MethodSpec>,
        min_ratio: Option<f64>,
        max_ratio: Option<f64>,
    ) -> std::result::Result<Option<Self>, InputError> {
        let Some(share) = share.or(spec.and_then(|s| s.coverage)) else {
            if min_ratio.is_some() || max_ratio.is_some() {
                let field = if min_ratio.is_some() { Field::MinRatio } else { Field::MaxRatio };
                return Err(InputError::new(
                    field,
                    "bounds a budget by coverage; add a coverage (e.g. 0.9, or the method as NAME~0.9) or drop it",
                ));
            }
            return Ok(None);
        };
        let d = Self::new(share);
        Ok(Some(Self { min_ratio: min_ratio.unwrap_or(d.min_ratio), max_ratio: max_ratio.unwrap_or(d.max_ratio), ..d }))
    }

    /// The least and the largest number of tokens it recomputes of `n`.
    pub fn bounds(&self, n: usize) -> (usize, usize) {
        (count_for_ratio(self.min_ratio, n), count_for_ratio(self.max_ratio, n))
    }

    /// Its values: a share in (0, 1], ratios in [0, 1] with the least not above the largest.
    pub fn check(&self) -> std::result::Result<(), InputError> {
        if !(self.share > 0.0 && self.share <= 1.0) {
            return Err(InputError::new(
                Field::Coverage,
                format!(
                    "{} is outside (0, 1]; give the share of the selection score mass to cover, e.g. 0.9",
                    self.share
                ),
            ));
        }
        for (r, field) in [(self.min_ratio, Field::MinRatio), (self.max_ratio, Field::MaxRatio)] {
            if !(0.0..=1.0).contains(&r) {
                return Err(InputError::new(field, format!("{r} is outside [0, 1]; give a fraction of the context")));
            }
        }
        if self.min_ratio > self.max_ratio {
            return Err(InputError::new(
                Field::MinRatio,
                format!("{} is above the largest ratio {}; give bounds in order", self.min_ratio, self.max_ratio),
            ));
        }
        Ok(())
    }
}

/// A method as users write it, parsed and printed here only: on the command line (`run`,
/// `bench`, `eval`), in eval records and in projections. `NAME[+reorder][@RATIO|~COVERAGE]`:
/// `infoflow`, `infoflow+reorder` (chunks reordered by importance first), `infoflow@0.15`
/// (a recompute ratio), `infoflow~0.9` (a budget by coverage, [`Coverage`]); `NAME:RATIO` is
/// read as `NAME@RATIO`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MethodSpec {
    /// The method.
    pub method: Method,
    /// Chunks reordered before the prompt (`+reorder`).
    pub reorder: bool,
    /// Recompute ratio, when the spec names one.
    pub ratio: Option<f64>,
    /// Coverage share (`~C`), when the spec names one instead of a ratio.
    pub coverage: Option<f64>,
}

impl MethodSpec {
    /// `method` alone: no reordering, no ratio.
    pub const fn new(method: Method) -> Self {
        Self { method, reorder: false, ratio: None, coverage: None }
    }

    /// The same spec at `ratio`.
    pub fn at(self, ratio: f64) -> Self {
        Self { ratio: Some(ratio), coverage: None, ..self }
    }

    /// The same spec with a budget by coverage `share`.
    pub fn covering(self, share: f64) -> Self {
        Self { ratio: None, coverage: Some(share), ..self }
    }

    /// A comma-separated list of specs (empty items skipped).
    pub fn parse_list(list: &str) -> std::result::Result<Vec<Self>, InputError> {
        list.split(',').map(str::trim).filter(|m| !m.is_empty()).map(str::parse).collect()
    }

    /// `base` with the method, ratio and reordering of a request that may give a spec and,
    /// apart, a ratio and a reorder setting (the command line's `--method` / `--ratio` /
    /// `--reorder`, the API's `method` / `ratio` / `reorder` fields): each knob may be said in
    /// either place, and said in both it must agree. What is said nowhere stays as in `base`.
    /// The ratio is checked to lie in [0, 1]. A budget by coverage (`coverage`, or the spec's
    /// `~C` with the default bounds) replaces the ratio: giving both is an error. One function
    /// for every command and the API.
    pub fn merge(
        spec: Option<Self>,
        ratio: Option<f64>,
        coverage: Option<Coverage>,
        reorder: Option<bool>,
        base: RunOptions,
    ) -> std::result::Result<RunOptions, InputError> {
        let mut o = base;
        let spec_coverage = spec.and_then(|s| s.coverage);
        if let (Some(a), Some(b)) = (spec_coverage, coverage) {
            if a != b.share {
                return Err(InputError::new(
                    Field::Coverage,
                    format!("the method says coverage {a} and the coverage says {}: give it once", b.share),
                ));
            }
        }
        if let Some(c) = coverage.or(spec_coverage.map(Coverage::new)) {
            if let Some(r) = ratio.or(spec.and_then(|s| s.ratio)) {
                return Err(InputError::new(
                    Field::Coverage,
                    format!("a coverage budget ({}) replaces the ratio ({r}): give one of them", c.share),
                ));
            }
            c.check()?;
            o.coverage = Some(c);
        }
        if let Some(spec) = spec {
            o.method = spec.method;
            if let (Some(a), Some(b)) = (spec.ratio, ratio) {
                if a != b {
                    return Err(InputError::new(
                        Field::Ratio,
                        format!("the method says ratio {a} (`{spec}`) and the ratio says {b}: give the ratio once"),
                    ));
                }
            }
            if spec.reorder && reorder == Some(false) {
                return Err(InputError::new(
                    Field::Reorder,
                    format!("the method says +reorder (`{spec}`) and the reorder setting says false: give one of them"),
                ));
            }
        }
        if let Some(r) = ratio.or(spec.and_then(|s| s.ratio)) {
            check_ratio(r)?;
            // A ratio given to a method that takes none would be dropped without a word.
            let what = match o.method.info().recompute {
                crate::method::Recompute::Selected => None,
                crate::method::Recompute::Nothing => Some("recomputes no token"),
                crate::method::Recompute::Everything => Some("computes every token"),
            };
            if let Some(what) = what {
                let takes: Vec<&str> = Method::ALL
                    .iter()
                    .filter(|m| m.info().recompute == crate::method::Recompute::Selected && **m != Method::Auto)
                    .map(|m| m.name())
                    .collect();
                return Err(InputError::new(
                    Field::Ratio,
                    format!(
                        "{r}: method {} {what} and takes no ratio; drop the ratio, or choose a method that selects \
                         tokens: {}",
                        o.method,
                        takes.join(", ")
                    ),
                ));
            }
            o.ratio = r;
        }
        o.reorder = reorder.unwrap_or(o.reorder) || spec.is_some_and(|s| s.reorder);
        Ok(o)
    }

    /// Run options of this spec (the ratio given here, else `default_ratio`; a coverage given
    /// here with the default bounds).
    pub fn options(&self, default_ratio: f64) -> RunOptions {
        RunOptions {
            method: self.method,
            reorder: self.reorder,
            ratio: self.ratio.unwrap_or(default_ratio),
            coverage: self.coverage.map(Coverage::new),
            ..RunOptions::default()
        }
    }
}

impl FromStr for MethodSpec {
    type Err = InputError;
    fn from_str(s: &str) -> std::result::Result<Self, InputError> {
        let s = s.trim();
        let (mut rest, mut ratio, mut coverage) = (s, None, None);
        if let Some((head, c)) = s.split_once('~') {
            let share: f64 = c.trim().parse().map_err(|_| {
                InputError::new(Field::Coverage, format!("`{s}`: `{c}` is not a share (write e.g. infoflow~0.9)"))
            })?;
            Coverage::new(share).check()?;
            (rest, coverage) = (head, Some(share));
        }
        if let Some((head, r)) = rest.split_once(['@', ':']) {
            let r: f64 = r.trim().parse().map_err(|_| {
                InputError::new(Field::Ratio, format!("`{s}`: `{r}` is not a ratio (write e.g. infoflow@0.15)"))
            })?;
            check_ratio(r)?;
            if coverage.is_some() {
                return Err(InputError::new(
                    Field::Coverage,
                    format!("`{s}`: give a ratio (@) or a coverage (~), not both"),
                ));
            }
            (rest, ratio) = (head, Some(r));
        }
        let (name, reorder) = rest.strip_suffix("+reorder").map_or((rest, false), |n| (n, true));
        Ok(Self { method: name.parse()?, reorder, ratio, coverage })
    }
}

impl std::fmt::Display for MethodSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.method.name())?;
        if self.reorder {
            f.write_str("+reorder")?;
        }
        match (self.ratio, self.coverage) {
            (Some(r), _) => write!(f, "@{r}"),
            (None, Some(c)) => write!(f, "~{c}"),
            (None, None) => Ok(()),
        }
    }
}

impl serde::Serialize for MethodSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for MethodSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        // The problem alone: a JSON field is named by its path, not by a command-line flag.
        s.parse().map_err(|e: InputError| serde::de::Error::custom(e.problem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{validate, Context, Request};

    #[test]
    fn method_specs_parse_and_print_in_one_grammar() {
        for (text, method, reorder, ratio, printed) in [
            ("infoflow", Method::Infoflow, false, None, "infoflow"),
            ("infoflow+reorder", Method::Infoflow, true, None, "infoflow+reorder"),
            ("infoflow@0.15", Method::Infoflow, false, Some(0.15), "infoflow@0.15"),
            (" infoflow:0.3 ", Method::Infoflow, false, Some(0.3), "infoflow@0.3"),
            ("EPIC+reorder@1", Method::Epic, true, Some(1.0), "epic+reorder@1"),
            ("full", Method::Full, false, None, "full"),
        ] {
            let spec: MethodSpec = text.parse().unwrap();
            assert_eq!(spec, MethodSpec { method, reorder, ratio, coverage: None }, "{text}");
            assert_eq!(spec.to_string(), printed);
            assert_eq!(printed.parse::<MethodSpec>().unwrap(), spec, "printing is parseable");
            let json = serde_json::to_string(&spec).unwrap();
            assert_eq!(json, format!("\"{printed}\""));
            assert_eq!(serde_json::from_str::<MethodSpec>(&json).unwrap(), spec);
        }
        for (bad, field) in [
            ("magic", Field::Method),
            ("infoflow@x", Field::Ratio),
            ("infoflow@1.5", Field::Ratio),
            ("infoflow+reorder+reorder", Field::Method),
        ] {
            let e = bad.parse::<MethodSpec>().unwrap_err();
            assert_eq!(e.field, field, "{bad}: {e}");
        }
        let list = MethodSpec::parse_list("full, none,,infoflow+reorder@0.2").unwrap();
        assert_eq!(list.iter().map(ToString::to_string).collect::<Vec<_>>(), ["full", "none", "infoflow+reorder@0.2"]);
        let o = list[2].options(0.15);
        assert!(o.reorder && o.method == Method::Infoflow && o.ratio == 0.2);
        assert_eq!(MethodSpec::new(Method::Epic).options(0.15).ratio, 0.15);
        // A ratio for a method that takes none is refused, not dropped.
        let base = RunOptions::default();
        for (m, says) in [(Method::Full, "computes every token"), (Method::None, "recomputes no token")] {
            let e = MethodSpec::merge(Some(MethodSpec::new(m)), Some(0.3), None, None, base.clone()).unwrap_err();
            assert_eq!(e.field, Field::Ratio, "{m}: {e}");
            assert!(e.problem.contains(says) && e.problem.contains("infoflow"), "{m}: {e}");
        }
        let o = MethodSpec::merge(Some(MethodSpec::new(Method::Full)), None, None, None, base.clone()).unwrap();
        assert_eq!(o.method, Method::Full, "no ratio given: fine");
        let o = MethodSpec::merge(Some(MethodSpec::new(Method::Auto)), Some(0.3), None, None, base).unwrap();
        assert_eq!(o.ratio, 0.3, "auto takes the ratio its candidates run at");
    }

    #[test]
    fn coverage_specs_parse_print_and_refuse_what_does_not_fit() {
        let spec: MethodSpec = "infoflow+reorder~0.9".parse().unwrap();
        assert_eq!(spec, MethodSpec { method: Method::Infoflow, reorder: true, ratio: None, coverage: Some(0.9) });
        assert_eq!(spec.to_string(), "infoflow+reorder~0.9");
        assert_eq!(spec.options(0.15).coverage, Some(Coverage::new(0.9)));
        for (bad, field) in
            [("infoflow~0", Field::Coverage), ("infoflow~1.2", Field::Coverage), ("infoflow@0.2~0.9", Field::Coverage)]
        {
            assert_eq!(bad.parse::<MethodSpec>().unwrap_err().field, field, "{bad}");
        }
        let base = RunOptions::default();
        let spec = MethodSpec::new(Method::Infoflow);
        let c = Coverage { share: 0.8, min_ratio: 0.05, max_ratio: 0.5 };
        assert_eq!(MethodSpec::merge(Some(spec), None, Some(c), None, base.clone()).unwrap().coverage, Some(c));
        let e = MethodSpec::merge(Some(spec), Some(0.2), Some(c), None, base.clone()).unwrap_err();
        assert_eq!(e.field, Field::Coverage);
        let e = MethodSpec::merge(Some(spec.covering(0.7)), None, Some(c), None, base.clone()).unwrap_err();
        assert_eq!(e.field, Field::Coverage);
        for (c, field) in [
            (Coverage::new(0.0), Field::Coverage),
            (Coverage::new(f64::NAN), Field::Coverage),
            (Coverage { min_ratio: -0.1, ..Coverage::new(0.9) }, Field::MinRatio),
            (Coverage { max_ratio: 1.1, ..Coverage::new(0.9) }, Field::MaxRatio),
            (Coverage { min_ratio: 0.6, max_ratio: 0.5, ..Coverage::new(0.9) }, Field::MinRatio),
        ] {
            assert_eq!(c.check().unwrap_err().field, field, "{c:?}");
        }
        // Only a method whose scores are a mass takes a coverage budget.
        let req = Request {
            conversation: Default::default(),
            context: Context::Documents(vec!["a document".into()]),
            query: "q".into(),
            system: None,
            answer_prefix: None,
        };
        for m in Method::ALL {
            let r = validate(&req, &RunOptions { method: m, coverage: Some(Coverage::new(0.9)), ..base.clone() });
            assert_eq!(r.is_ok(), m.scores_mass(), "{m}");
            if let Err(e) = r {
                assert!(e.to_string().contains("--coverage") && e.to_string().contains("infoflow"), "{e}");
            }
        }
        assert_eq!(Coverage { min_ratio: 0.1, max_ratio: 0.5, ..Coverage::new(0.9) }.bounds(101), (10, 51));
    }
}
