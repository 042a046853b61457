//! Seeded English prose for benchmarks and haystacks, generated here (no downloaded data).
//!
//! Sentences come from a small grammar over a few hundred words, so the text tokenizes like
//! ordinary English (varied words, punctuation, numbers, names) and is reproducible from a
//! seed. It carries no facts a question could be about; tests hide their needles in it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const NAMES: &[&str] = &[
    "Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lucas", "Mira",
    "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Stefan", "Tara", "Umar", "Vera", "Walter", "Yusuf",
];
const PLACES: &[&str] = &[
    "the harbour",
    "the old mill",
    "the library",
    "the market square",
    "the valley",
    "the northern ridge",
    "the river bank",
    "the railway station",
    "the orchard",
    "the lighthouse",
    "the workshop",
    "the town hall",
    "the quarry",
    "the meadow",
    "the monastery",
    "the bridge",
    "the salt marsh",
    "the observatory",
];
const TOWNS: &[&str] = &[
    "Aldermoor",
    "Brackenford",
    "Castlewick",
    "Dunmere",
    "Eastholm",
    "Fernhollow",
    "Glenrock",
    "Hartsfield",
    "Ironbridge",
    "Kingsmead",
    "Lowbury",
    "Marshgate",
    "Northcliff",
    "Oakhaven",
    "Redwater",
    "Stonebridge",
];
const ADJ: &[&str] = &[
    "quiet",
    "narrow",
    "ancient",
    "busy",
    "gentle",
    "crowded",
    "distant",
    "bright",
    "weathered",
    "careful",
    "patient",
    "curious",
    "heavy",
    "silver",
    "wooden",
    "steep",
    "fertile",
    "windy",
    "humble",
    "sturdy",
    "remarkable",
    "ordinary",
    "forgotten",
    "modest",
    "broad",
    "shallow",
    "golden",
    "restless",
];
const NOUNS: &[&str] = &[
    "farmer",
    "bell",
    "carpenter",
    "ledger",
    "lantern",
    "merchant",
    "road",
    "boat",
    "garden",
    "letter",
    "engine",
    "teacher",
    "bakery",
    "harvest",
    "map",
    "orchestra",
    "apprentice",
    "wall",
    "fountain",
    "clock",
    "shepherd",
    "canal",
    "printer",
    "festival",
    "weaver",
    "forge",
    "archive",
    "council",
    "storm",
    "journey",
];
const VERBS_PAST: &[&str] = &[
    "repaired",
    "visited",
    "described",
    "carried",
    "painted",
    "measured",
    "admired",
    "rebuilt",
    "studied",
    "followed",
    "crossed",
    "recorded",
    "guarded",
    "planted",
    "opened",
    "sold",
    "borrowed",
    "polished",
];
const ADVERBS: &[&str] = &[
    "slowly",
    "carefully",
    "every spring",
    "before dawn",
    "without complaint",
    "twice a year",
    "in secret",
    "with great care",
    "after the rains",
    "on quiet evenings",
    "for many years",
    "once again",
];
const TOPICS: &[&str] = &[
    "the history of the valley",
    "the keeping of bees",
    "river trade",
    "the building of stone bridges",
    "old weaving methods",
    "the local weather",
    "the seasons of the orchard",
    "the making of clocks",
    "the printing trade",
    "the salt works",
    "the tides along the coast",
    "the village school",
];

fn pick<'a>(rng: &mut StdRng, xs: &[&'a str]) -> &'a str {
    xs[rng.random_range(0..xs.len())]
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

/// One sentence of the grammar.
pub fn sentence(rng: &mut StdRng) -> String {
    let s = match rng.random_range(0..12) {
        0 => format!(
            "the {} {} {} the {} {} near {}.",
            pick(rng, ADJ),
            pick(rng, NOUNS),
            pick(rng, VERBS_PAST),
            pick(rng, ADJ),
            pick(rng, NOUNS),
            pick(rng, PLACES)
        ),
        1 => format!(
            "in {}, {} {} a {} {} in {}.",
            rng.random_range(1620..1990),
            pick(rng, NAMES),
            pick(rng, VERBS_PAST),
            pick(rng, ADJ),
            pick(rng, NOUNS),
            pick(rng, TOWNS)
        ),
        2 => format!(
            "{} {} {} {}, as the people of {} still remember.",
            pick(rng, NAMES),
            pick(rng, VERBS_PAST),
            pick(rng, PLACES),
            pick(rng, ADVERBS),
            pick(rng, TOWNS)
        ),
        3 => format!("many visitors came to {} to learn about {}.", pick(rng, PLACES), pick(rng, TOPICS)),
        4 => format!(
            "it is said that the {} of {} was {} and {}.",
            pick(rng, NOUNS),
            pick(rng, TOWNS),
            pick(rng, ADJ),
            pick(rng, ADJ)
        ),
        5 => format!(
            "by the end of the season, {} had {} {} {}s.",
            pick(rng, NAMES),
            pick(rng, VERBS_PAST),
            rng.random_range(3..250),
            pick(rng, NOUNS)
        ),
        6 => format!(
            "the road from {} to {} was {} and {}, so travellers rested at {}.",
            pick(rng, TOWNS),
            pick(rng, TOWNS),
            pick(rng, ADJ),
            pick(rng, ADJ),
            pick(rng, PLACES)
        ),
        7 => format!(
            "{} wrote a long letter about {} and sent it to {}.",
            pick(rng, NAMES),
            pick(rng, TOPICS),
            pick(rng, NAMES)
        ),
        8 => format!(
            "nobody could say why the {} {} had been {} {}.",
            pick(rng, ADJ),
            pick(rng, NOUNS),
            pick(rng, VERBS_PAST),
            pick(rng, ADVERBS)
        ),
        9 => format!(
            "the {} of {} counted {} {}s and {} {}s that year.",
            pick(rng, NOUNS),
            pick(rng, TOWNS),
            rng.random_range(2..90),
            pick(rng, NOUNS),
            rng.random_range(2..90),
            pick(rng, NOUNS)
        ),
        10 => format!(
            "when the {} arrived, the {} {} {} {}.",
            pick(rng, NOUNS),
            pick(rng, ADJ),
            pick(rng, NOUNS),
            pick(rng, VERBS_PAST),
            pick(rng, PLACES)
        ),
        _ => format!(
            "according to the {} {}, {} was known for {}.",
            pick(rng, ADJ),
            pick(rng, NOUNS),
            pick(rng, TOWNS),
            pick(rng, TOPICS)
        ),
    };
    capitalize(&s)
}

/// A paragraph of 4 to 7 sentences.
pub fn paragraph(rng: &mut StdRng) -> String {
    let n = rng.random_range(4..8);
    (0..n).map(|_| sentence(rng)).collect::<Vec<_>>().join(" ")
}

/// Prose of at least `min_chars` characters, paragraphs separated by blank lines.
pub fn prose(seed: u64, min_chars: usize) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = String::new();
    while out.len() < min_chars {
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(&paragraph(&mut rng));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_long_enough() {
        let a = prose(7, 5000);
        assert_eq!(a, prose(7, 5000));
        assert_ne!(a, prose(8, 5000));
        assert!(a.len() >= 5000);
        assert!(a.contains(". "));
    }
}
