//! Memory limits: what a request is estimated to need, checked before anything is allocated.
//!
//! The compiler, the generators and the CPU executor estimate the bytes a request takes from its
//! sizes alone (ops, tasks, ranks, chunks, element size) and refuse one over the limit with
//! [`TooLarge`], which names the request, the estimate and the limit. Where an estimate cannot be
//! made ahead (a buffer whose size only a pass finds out), the allocation is fallible
//! ([`try_vec`]) and its failure is a [`TooLarge`] too, never an abort.
//!
//! The limit is the caller's ([`crate::compile::Options::memory_limit`], the `_within` forms of the
//! generators and executors); the default, [`default_limit`], is what this process can still
//! allocate: the smallest of the memory the system has available and the room left under the
//! process's address-space and data-size limits (`ulimit -v`, `ulimit -d`).

use std::fmt;

/// A request whose estimated memory is above the limit, or whose allocation failed.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct TooLarge {
    /// What was asked for, in words (`compiling hm_allreduce_1024x8: 134201344 ops, 268402688 tasks`).
    pub request: String,
    /// The bytes it needs: the estimate, or the size of the allocation that failed.
    pub needed: u64,
    /// The limit it was held to, in bytes; `None` when an allocation failed under no estimate
    /// (the system refused it).
    pub limit: Option<u64>,
}

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.limit {
            Some(limit) => write!(
                f,
                "{} needs about {} of memory, more than the {} limit",
                self.request,
                Bytes(self.needed),
                Bytes(limit)
            ),
            None => write!(f, "{}: allocating {} failed (out of memory)", self.request, Bytes(self.needed)),
        }
    }
}

impl std::error::Error for TooLarge {}

/// A byte count printed in GiB or MiB with the exact value: `6.25 GiB (6710886400 B)`.
#[derive(Copy, Clone)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b >= 1 << 30 {
            write!(f, "{:.2} GiB ({b} B)", b as f64 / (1u64 << 30) as f64)
        } else {
            write!(f, "{:.1} MiB ({b} B)", b as f64 / (1u64 << 20) as f64)
        }
    }
}

/// Checks `needed` bytes against `limit`; `request` names what is asked for.
pub fn check(limit: u64, needed: u64, request: impl FnOnce() -> String) -> Result<(), TooLarge> {
    if needed > limit {
        return Err(TooLarge { request: request(), needed, limit: Some(limit) });
    }
    Ok(())
}

/// A vector with room for `n` items, allocated fallibly: `Err` names `what` and the bytes.
pub fn try_vec<T>(n: usize, what: &str) -> Result<Vec<T>, TooLarge> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| TooLarge {
        request: what.to_string(),
        needed: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        limit: None,
    })?;
    Ok(v)
}

/// `n` copies of `x` in a fallibly allocated vector (see [`try_vec`]).
pub fn try_filled<T: Clone>(n: usize, x: T, what: &str) -> Result<Vec<T>, TooLarge> {
    let mut v = try_vec(n, what)?;
    v.resize(n, x);
    Ok(v)
}

/// Used when nothing says how much this process may allocate (no `/proc`): 16 GiB.
pub const FALLBACK_LIMIT: u64 = 16 << 30;

/// The default limit: the bytes this process can still allocate. On Linux the smallest of
/// `MemAvailable` (`/proc/meminfo`) and the room left under the soft address-space and data-size
/// limits (`/proc/self/limits` less `VmSize` and `VmData` of `/proc/self/status`); elsewhere, or
/// where none of these can be read, [`FALLBACK_LIMIT`].
pub fn default_limit() -> u64 {
    let kib = |text: &str, key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse::<u64>().ok().map(|k| k.saturating_mul(1024))
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    // `Max address space  4096000000  4096000000  bytes`: the soft limit is the first number.
    let soft = |name: &str| -> Option<u64> {
        let line = limits.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].split_whitespace().next()?.parse::<u64>().ok()
    };
    let room = |limit: Option<u64>, used: Option<u64>| limit.map(|l| l.saturating_sub(used.unwrap_or(0)));
    [
        kib(&meminfo, "MemAvailable:"),
        room(soft("Max address space"), kib(&status, "VmSize:")),
        room(soft("Max data size"), kib(&status, "VmData:")),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(FALLBACK_LIMIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_over_the_limit_names_itself_and_both_sizes() {
        let e = check(1 << 30, 3 << 30, || "compiling x".into()).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("compiling x") && s.contains("3.00 GiB") && s.contains("1.00 GiB"), "{s}");
        assert!(check(1 << 30, 1 << 30, || unreachable!()).is_ok());
    }

    #[test]
    fn an_impossible_allocation_is_an_error() {
        let e = try_vec::<u64>(usize::MAX / 4, "a table").unwrap_err();
        assert_eq!(e.limit, None);
        assert!(e.to_string().contains("a table"));
    }

    #[test]
    fn the_default_limit_is_positive() {
        assert!(default_limit() > 0);
    }
}
