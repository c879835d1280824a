//! Fuzzing the program text format: random bytes, soups of its directives and ops with hostile
//! numbers, and printed random programs mutated line by line. Every input must parse or give a
//! typed error naming a line: no panic, no hang; a program that parses and verifies prints back to
//! itself. [`fuzz_common::cases`] executions per strategy.

mod common;
mod fuzz_common;

use common::{Rng, random_program};
use oxccl_host::program::{ProgramError, text};
use proptest::prelude::*;

fn exercise(t: &str) {
    fuzz_common::guard(t, || match text::parse(t) {
        Ok(p) => {
            if p.verify().is_ok() {
                let _ = p.check();
                assert_eq!(text::parse(&text::print(&p)).as_ref(), Ok(&p), "print/parse round trip");
            }
        }
        Err(ProgramError::Parse { line, .. }) => assert!(line >= 1 && line <= t.lines().count().max(1), "line {line}"),
        Err(ProgramError::BadLayout { .. }) => {}
        Err(other) => panic!("unexpected error kind: {other:?}"),
    });
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "-1",
    "+2",
    "4294967295",
    "4294967296",
    "1048576",
    "1048577",
    "16777216",
    "99999999999999999999",
    "x",
    "",
];

fn number() -> impl Strategy<Value = String> {
    (0..NUMBERS.len()).prop_map(|i| NUMBERS[i].to_string())
}

fn slice() -> impl Strategy<Value = String> {
    (prop_oneof![Just("in"), Just("out"), Just("scr"), Just("x")], number(), prop::option::of(number())).prop_map(
        |(b, a, e)| match e {
            Some(e) => format!("{b}[{a}..{e}]"),
            None => format!("{b}[{a}]"),
        },
    )
}

/// One line of the format, or something close to one.
fn line() -> impl Strategy<Value = String> {
    let coll = prop_oneof![
        Just("allreduce"),
        Just("allgather"),
        Just("reduce_scatter"),
        Just("alltoall"),
        Just("broadcast"),
        Just("reduce"),
        Just("x")
    ];
    // Sometimes a root, which only Broadcast and Reduce take.
    let root = prop::option::of(number()).prop_map(|r| r.map(|r| format!(" root={r}")).unwrap_or_default());
    let attrs = || {
        (number(), number(), number(), number()).prop_map(|(a, b, c, d)| format!("ch={a} chunk={b} step={c} stage={d}"))
    };
    prop_oneof![
        (prop_oneof![Just("p"), Just("a#b"), Just("")]).prop_map(|n| format!("program {n}")),
        (coll, number(), number(), root, prop_oneof![Just("inplace"), Just("outofplace"), Just("x")])
            .prop_map(|(c, r, k, o, p)| format!("collective {c} ranks={r} chunks={k}{o} {p}")),
        prop::collection::vec(number(), 0..6).prop_map(|v| format!("scratch {}", v.join(" "))),
        number().prop_map(|g| format!("ranks-per-node {g}")),
        (number(), number(), slice(), number(), slice(), prop_oneof![Just("recv"), Just("rrc"), Just("x")], attrs())
            .prop_map(|(i, a, s, b, d, o, t)| format!("op{i} = xfer r{a} {s} -> r{b} {d} {o} {t}")),
        (number(), prop_oneof![Just("copy"), Just("reduce")], number(), slice(), slice(), attrs())
            .prop_map(|(i, k, r, s, d, t)| format!("op{i} = {k} r{r} {s} -> {d} {t}")),
        Just("# comment".to_string()),
        Just("".to_string()),
    ]
}

proptest! {
    #![proptest_config(fuzz_common::config())]

    #[test]
    fn random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        exercise(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn line_soup(lines in prop::collection::vec(line(), 0..40)) {
        exercise(&lines.join("\n"));
    }

    #[test]
    fn mutated_programs(seed in any::<u64>(), edits in prop::collection::vec((any::<u32>(), 0u32..6, any::<u8>()), 0..6)) {
        let mut rng = Rng::new(seed);
        let ranks = 2 + rng.below(3);
        let coll = common::nth_collective(rng.below(common::COLLECTIVES as u32) as usize, rng.next(), ranks);
        let p = random_program(rng.next(), coll, ranks, 1 + rng.below(2), 1 + rng.below(3));
        let mut t = text::print(&p);
        assert_eq!(text::parse(&t).as_ref(), Ok(&p));
        for (at, how, byte) in edits {
            let mut lines: Vec<String> = t.lines().map(str::to_string).collect();
            if lines.is_empty() { break; }
            let i = at as usize % lines.len();
            match how {
                0 => { lines.remove(i); }
                1 => { let l = lines[i].clone(); lines.insert(i, l); }
                2 => { let j = (at as usize / 7) % lines.len(); lines.swap(i, j); }
                3 => {
                    // A number replaced by a hostile one.
                    let l = &mut lines[i];
                    if let Some(k) = l.find(|c: char| c.is_ascii_digit()) {
                        let end = l[k..].find(|c: char| !c.is_ascii_digit()).map_or(l.len(), |e| k + e);
                        l.replace_range(k..end, NUMBERS[byte as usize % NUMBERS.len()]);
                    }
                }
                4 => {
                    let l = &mut lines[i];
                    let k = (byte as usize) % (l.len() + 1);
                    let k = (0..=k).rev().find(|&k| l.is_char_boundary(k)).unwrap_or(0);
                    l.insert(k, [' ', '#', '[', ']', '.', '=', '-'][byte as usize % 7]);
                }
                _ => {
                    let l = &mut lines[i];
                    let k = (byte as usize) % (l.len() + 1);
                    let k = (0..=k).rev().find(|&k| l.is_char_boundary(k)).unwrap_or(0);
                    l.truncate(k);
                }
            }
            t = lines.join("\n");
        }
        exercise(&t);
    }
}
