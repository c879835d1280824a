//! The outcome of checking outputs against what they should hold: one report for the program
//! executors' `verify` ([`crate::exec::verify`], [`crate::compile::direct::verify`]) and
//! reshard's ([`crate::reshard::exec::verify`]).

/// How many elements were checked, how many were wrong, and the first wrong ones. `W` is what a
/// wrong element is: `(rank, index)` for a collective's output, a
/// [`crate::reshard::exec::Mismatch`] for a reshard's destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport<W> {
    /// Elements checked, over every rank.
    pub checked: u64,
    /// Elements that did not hold what they should.
    pub wrong: u64,
    /// The first wrong elements, at most [`VerifyReport::LISTED`]; `wrong` counts them all.
    pub first: Vec<W>,
}

impl<W> Default for VerifyReport<W> {
    fn default() -> Self {
        VerifyReport { checked: 0, wrong: 0, first: Vec::new() }
    }
}

impl<W> VerifyReport<W> {
    /// How many wrong elements are listed in `first`.
    pub const LISTED: usize = 16;

    /// Whether every element checked held what it should.
    pub fn is_exact(&self) -> bool {
        self.wrong == 0
    }

    /// Counts `n` wrong elements, listing the first of them (`w()`, made only when it is listed)
    /// while fewer than [`VerifyReport::LISTED`] are listed.
    pub fn record(&mut self, n: u64, w: impl FnOnce() -> W) {
        self.wrong += n;
        if self.first.len() < Self::LISTED {
            self.first.push(w());
        }
    }
}

impl VerifyReport<(usize, usize)> {
    /// Adds rank `rank`'s output `got`, compared element by element with its reference `want`. An
    /// output of the wrong length counts its whole reference as wrong, listed at index 0.
    pub fn tally<T: PartialEq>(&mut self, rank: usize, got: &[T], want: &[T]) {
        self.checked += want.len() as u64;
        if got.len() != want.len() {
            self.record(want.len() as u64, || (rank, 0));
            return;
        }
        for (i, _) in got.iter().zip(want).enumerate().filter(|(_, (a, b))| a != b) {
            self.record(1, || (rank, i));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::VerifyReport;

    #[test]
    fn a_report_counts_mismatches_and_whole_outputs_of_the_wrong_length() {
        let mut r = VerifyReport::default();
        r.tally(0, &[1, 2, 3], &[1, 2, 3]);
        assert_eq!((r.checked, r.wrong, r.first.clone()), (3, 0, vec![]));
        r.tally(1, &[1, 9, 3, 9], &[1, 2, 3, 4]);
        assert_eq!((r.checked, r.wrong, r.first.clone()), (7, 2, vec![(1, 1), (1, 3)]));
        r.tally(2, &[1, 2], &[1, 2, 3]);
        assert_eq!((r.checked, r.wrong, r.first.clone()), (10, 5, vec![(1, 1), (1, 3), (2, 0)]));
        assert!(!r.is_exact());
    }

    #[test]
    fn only_the_first_are_listed_but_all_are_counted() {
        let mut r = VerifyReport::default();
        let want = vec![0u8; 100];
        r.tally(4, &[1u8; 100], &want);
        assert_eq!((r.checked, r.wrong, r.first.len()), (100, 100, VerifyReport::<(usize, usize)>::LISTED));
        assert_eq!(r.first[15], (4, 15));
    }
}
