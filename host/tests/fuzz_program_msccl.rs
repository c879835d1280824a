//! Fuzzing the MSCCL importer: random bytes, soups of MSCCL-like tags and attributes with hostile
//! values, and generated files mutated structurally and textually. Every input must give a
//! program or a typed error: no panic, no hang (`fuzz_common::guard`), and a program it gives
//! verifies and survives the text format. [`fuzz_common::cases`] executions per strategy.

mod common;
mod fuzz_common;
mod msccl_gen;

use common::Rng;
use oxccl_host::program::msccl::{import, import_unchecked};
use oxccl_host::program::text;
use proptest::prelude::*;

/// Imports `xml` both ways under the watchdog; whatever is imported must verify and print back.
fn exercise(xml: &str) {
    fuzz_common::guard(xml, || {
        if let Ok(imp) = import(xml) {
            imp.program.check().expect("an imported program passes its check");
            assert_eq!(imp.origin.len(), imp.program.ops.len());
            assert_eq!(text::parse(&text::print(&imp.program)).as_ref(), Ok(&imp.program));
        }
        if let Ok(imp) = import_unchecked(xml) {
            imp.program.verify().expect("an imported program is well formed");
        }
    });
}

const ELEMENTS: &[&str] = &["algo", "gpu", "tb", "step", "op", "copy", "x"];
const KEYS: &[&str] = &[
    "name",
    "coll",
    "ngpus",
    "nchunksperloop",
    "inplace",
    "outofplace",
    "proto",
    "id",
    "i_chunks",
    "o_chunks",
    "s_chunks",
    "send",
    "recv",
    "chan",
    "s",
    "step",
    "type",
    "srcbuf",
    "srcoff",
    "dstbuf",
    "dstoff",
    "buf",
    "off",
    "cnt",
    "depid",
    "deps",
    "hasdep",
    "i_off",
    "o_off",
];
const VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "-1",
    "-2",
    "7",
    "16",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "99999999999999999999",
    "i",
    "o",
    "s",
    "r",
    "rrs",
    "rrc",
    "rcs",
    "rrcs",
    "cpy",
    "re",
    "nop",
    "allreduce",
    "allgather",
    "reduce_scatter",
    "alltoall",
    "",
    " 1 ",
    "1e3",
    "&amp;",
    "&#10;",
    "&#0;",
    "&bad;",
];

/// A tag, a closing tag or text, from the dictionaries above.
fn token() -> impl Strategy<Value = String> {
    let attr = (0..KEYS.len(), 0..VALUES.len()).prop_map(|(k, v)| format!(" {}=\"{}\"", KEYS[k], VALUES[v]));
    prop_oneof![
        4 => (0..ELEMENTS.len(), prop::collection::vec(attr, 0..8), any::<bool>()).prop_map(|(e, attrs, empty)| {
            format!("<{}{}{}>\n", ELEMENTS[e], attrs.concat(), if empty { "/" } else { "" })
        }),
        2 => (0..ELEMENTS.len()).prop_map(|e| format!("</{}>\n", ELEMENTS[e])),
        1 => prop_oneof![Just("text".to_string()), Just("<!-- c -->".into()), Just("<?xml version=\"1.0\"?>".into()), Just("<![CDATA[x]]>".into()), Just("<".into()), Just("\"".into())],
    ]
}

proptest! {
    #![proptest_config(fuzz_common::config())]

    #[test]
    fn random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        exercise(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn tag_soup(tokens in prop::collection::vec(token(), 0..80)) {
        exercise(&tokens.concat());
    }

    #[test]
    fn mutated_files(seed in any::<u64>(), mutations in 0u32..6, textual in 0u32..3, hostile in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let mut doc = msccl_gen::generated(&mut rng);
        for _ in 0..mutations {
            msccl_gen::mutate(&mut doc, &mut rng);
        }
        let mut xml = doc.print();
        if hostile {
            // One number replaced by an extreme one.
            let numbers: Vec<usize> = xml.match_indices("=\"").map(|(i, _)| i + 2).filter(|&i| xml.as_bytes().get(i).is_some_and(|b| b.is_ascii_digit() || *b == b'-')).collect();
            if let Some(&at) = numbers.get(rng.below(numbers.len().max(1) as u32) as usize) {
                let end = at + xml[at..].find('"').unwrap_or(0);
                let v = ["4294967295", "2147483647", "-2147483648", "16777216", "1048576", "99999999999"][rng.below(6) as usize];
                xml.replace_range(at..end, v);
            }
        }
        for _ in 0..textual {
            xml = msccl_gen::mutate_text(&xml, &mut rng);
        }
        exercise(&xml);
    }
}
