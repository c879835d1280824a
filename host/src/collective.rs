//! The collectives, one type for every front end: T-CCL plans ([`crate::tccl`]), transfer programs
//! ([`crate::program`]), the staged hierarchical calls ([`crate::nodes`]) and the library's API.

use serde::{Deserialize, Serialize};

/// A collective: what every rank's output holds once it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Collective {
    /// Every rank ends with the element-wise reduction of all ranks' inputs.
    AllReduce,
    /// Rank `r` ends with block `r` of the reduction (inputs hold `ranks` blocks).
    ReduceScatter,
    /// Every rank ends with all ranks' inputs, concatenated in rank order.
    AllGather,
    /// Every rank ends with the root's input. In a T-CCL plan only the root has an input buffer
    /// (out of place); a program's layout gives every rank one, and reads only the root's.
    Broadcast {
        /// The rank whose input every rank receives.
        root: u32,
    },
    /// The root ends with the element-wise reduction of all ranks' inputs. In a T-CCL plan only the
    /// root has an output buffer (out of place) and, in place, the other ranks' buffers are left as
    /// they are; a program promises nothing about the other ranks' outputs.
    Reduce {
        /// The rank that receives the reduction.
        root: u32,
    },
    /// Block `j` of rank `r`'s input ends as block `r` of rank `j`'s output (inputs and outputs
    /// hold `ranks` blocks). Out of place only in T-CCL plans, as in nccl's API.
    AllToAll,
}

impl Collective {
    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => (n - 1.0) / n,
            Collective::Broadcast { .. } | Collective::Reduce { .. } => 1.0,
        }
    }

    /// Every collective, the rooted ones with `root`: one list for whatever must cover them all.
    pub fn every(root: u32) -> [Collective; 6] {
        [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::Broadcast { root },
            Collective::Reduce { root },
            Collective::AllToAll,
        ]
    }

    /// Whether the collective has an in-place form in T-CCL plans (every one but AllToAll, as in
    /// nccl's API).
    pub fn has_in_place(self) -> bool {
        self != Collective::AllToAll
    }

    /// Whether the collective combines values (its operator matters).
    pub fn reduces(self) -> bool {
        !matches!(self, Collective::AllGather | Collective::Broadcast { .. } | Collective::AllToAll)
    }

    /// The root rank of Broadcast and Reduce.
    pub fn root(self) -> Option<usize> {
        match self {
            Collective::Broadcast { root } | Collective::Reduce { root } => Some(root as usize),
            _ => None,
        }
    }

    /// Whether the collective says what `rank`'s output holds: every rank's but a Reduce's off the
    /// root.
    pub fn defines_output(self, rank: usize) -> bool {
        match self {
            Collective::Reduce { root } => rank == root as usize,
            _ => true,
        }
    }

    /// The name as the CLI and nccl-tests spell it (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllToAll => "all_to_all",
        }
    }

    /// The name as MSCCL's `coll` attribute and the program text format spell it (`allreduce`,
    /// ...): the form programs are printed, fingerprinted and reported with.
    pub fn program_name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::ReduceScatter => "reducescatter",
            Collective::AllGather => "allgather",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllToAll => "alltoall",
        }
    }

    /// Parses a collective's name in any of the spellings real files use (`reduce_scatter`,
    /// `allgather`, `all-gather`, ..., case-insensitively). Broadcast and Reduce take `root`; a
    /// name that needs a root without one, or a root given to a collective that has none, is
    /// refused with the reason.
    pub fn parse(name: &str, root: Option<u32>) -> Result<Collective, ParseCollectiveError> {
        let n: String = name.chars().filter(|c| *c != '_' && *c != '-').collect::<String>().to_ascii_lowercase();
        let rooted = |make: fn(u32) -> Collective| match root {
            Some(root) => Ok(make(root)),
            None => Err(ParseCollectiveError::NoRoot { name: name.to_string() }),
        };
        let unrooted = |c: Collective| match root {
            None => Ok(c),
            Some(_) => Err(ParseCollectiveError::RootGiven { name: name.to_string() }),
        };
        match n.as_str() {
            "allreduce" => unrooted(Collective::AllReduce),
            "allgather" => unrooted(Collective::AllGather),
            "reducescatter" => unrooted(Collective::ReduceScatter),
            "alltoall" => unrooted(Collective::AllToAll),
            "broadcast" => rooted(|root| Collective::Broadcast { root }),
            "reduce" => rooted(|root| Collective::Reduce { root }),
            _ => Err(ParseCollectiveError::Unknown { name: name.to_string() }),
        }
    }
}

/// Why a collective's name did not parse ([`Collective::parse`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseCollectiveError {
    /// No collective has this name.
    #[error("unknown collective `{name}`")]
    Unknown {
        /// The name as written.
        name: String,
    },
    /// Broadcast or Reduce without the rank that is their root.
    #[error("`{name}` needs its root rank")]
    NoRoot {
        /// The name as written.
        name: String,
    },
    /// A root given to a collective that has none.
    #[error("`{name}` has no root")]
    RootGiven {
        /// The name as written.
        name: String,
    },
}

#[cfg(test)]
mod tests {
    use super::{Collective, ParseCollectiveError};

    #[test]
    fn names_parse_back_in_every_spelling() {
        for c in Collective::every(3) {
            let root = c.root().map(|r| r as u32);
            assert_eq!(Collective::parse(c.name(), root), Ok(c));
            assert_eq!(Collective::parse(c.program_name(), root), Ok(c));
            assert_eq!(Collective::parse(&c.name().to_uppercase().replace('_', "-"), root), Ok(c));
        }
        assert_eq!(
            Collective::parse("broadcast", None),
            Err(ParseCollectiveError::NoRoot { name: "broadcast".into() })
        );
        assert_eq!(
            Collective::parse("allreduce", Some(0)),
            Err(ParseCollectiveError::RootGiven { name: "allreduce".into() })
        );
        assert_eq!(Collective::parse("gather", None), Err(ParseCollectiveError::Unknown { name: "gather".into() }));
    }

    #[test]
    fn only_a_reduce_leaves_outputs_undefined_and_only_off_its_root() {
        for c in Collective::every(2) {
            let undefined: Vec<usize> = (0..4).filter(|&r| !c.defines_output(r)).collect();
            let want: Vec<usize> = if matches!(c, Collective::Reduce { .. }) { vec![0, 1, 3] } else { vec![] };
            assert_eq!(undefined, want, "{c:?}");
        }
    }
}
