//! CPU references of the collectives: pure functions on one `Vec<T>` per rank.
//!
//! Reductions fold ranks in order `0, 1, ..., n-1`; tests pick inputs (small integers, also in
//! floats) for which every order gives the same bits.

use super::{Element, ExecError, ReduceOp};
use crate::collective::Collective;

fn same_len<T>(inputs: &[Vec<T>]) -> Result<usize, ExecError> {
    let len = inputs.first().map(Vec::len).ok_or_else(|| ExecError::BadInput { reason: "no ranks".into() })?;
    if let Some((r, v)) = inputs.iter().enumerate().find(|(_, v)| v.len() != len) {
        return Err(ExecError::BadInput { reason: format!("rank {r} has {} elements, rank 0 has {len}", v.len()) });
    }
    Ok(len)
}

fn reduce_all<T: Element>(inputs: &[Vec<T>], op: ReduceOp, len: usize) -> Vec<T> {
    let mut acc = inputs[0].clone();
    for v in &inputs[1..] {
        T::combine(&mut acc[..len], &v[..len], op);
    }
    acc
}

/// AllReduce: every rank gets the element-wise reduction over ranks.
pub fn all_reduce<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Result<Vec<Vec<T>>, ExecError> {
    let len = same_len(inputs)?;
    let r = reduce_all(inputs, op, len);
    Ok(vec![r; inputs.len()])
}

/// AllGather: every rank gets the concatenation of all inputs, rank 0 first.
pub fn all_gather<T: Element>(inputs: &[Vec<T>]) -> Result<Vec<Vec<T>>, ExecError> {
    same_len(inputs)?;
    let all: Vec<T> = inputs.iter().flatten().copied().collect();
    Ok(vec![all; inputs.len()])
}

/// ReduceScatter: rank `r` gets block `r` (of `n` equal blocks) of the reduction.
pub fn reduce_scatter<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Result<Vec<Vec<T>>, ExecError> {
    let len = same_len(inputs)?;
    let n = inputs.len();
    if len % n != 0 {
        return Err(ExecError::BadInput { reason: format!("{len} elements do not split into {n} blocks") });
    }
    if len == 0 {
        return Ok(vec![Vec::new(); n]);
    }
    let r = reduce_all(inputs, op, len);
    Ok(r.chunks(len / n).map(<[T]>::to_vec).collect())
}

/// AllToAll: block `q` of rank `r`'s input becomes block `r` of rank `q`'s output.
pub fn all_to_all<T: Element>(inputs: &[Vec<T>]) -> Result<Vec<Vec<T>>, ExecError> {
    let len = same_len(inputs)?;
    let n = inputs.len();
    if len % n != 0 {
        return Err(ExecError::BadInput { reason: format!("{len} elements do not split into {n} blocks") });
    }
    let b = len / n;
    Ok((0..n).map(|q| (0..n).flat_map(|r| inputs[r][q * b..(q + 1) * b].iter().copied()).collect()).collect())
}

/// Broadcast: every rank's output is the root's input.
pub fn broadcast<T: Element>(inputs: &[Vec<T>], root: usize) -> Result<Vec<Vec<T>>, ExecError> {
    same_len(inputs)?;
    let from = inputs.get(root).ok_or_else(|| ExecError::BadInput {
        reason: format!("broadcast from root {root} among {} ranks", inputs.len()),
    })?;
    Ok(vec![from.clone(); inputs.len()])
}

/// Reduce: the root's output is the reduction of every rank's input; the other ranks' outputs are
/// not the collective's (empty here: [`crate::collective::Collective::defines_output`]).
pub fn reduce<T: Element>(inputs: &[Vec<T>], op: ReduceOp, root: usize) -> Result<Vec<Vec<T>>, ExecError> {
    if root >= inputs.len() {
        return Err(ExecError::BadInput { reason: format!("reduce to root {root} among {} ranks", inputs.len()) });
    }
    let len = same_len(inputs)?;
    let mut out = vec![Vec::new(); inputs.len()];
    out[root] = reduce_all(inputs, op, len);
    Ok(out)
}

/// The reference of `collective`: every rank's output; a rank whose output the collective does
/// not define ([`crate::collective::Collective::defines_output`]) gets an empty one.
pub fn reference<T: Element>(
    collective: Collective,
    inputs: &[Vec<T>],
    op: ReduceOp,
) -> Result<Vec<Vec<T>>, ExecError> {
    super::check_op(op)?;
    match collective {
        Collective::AllReduce => all_reduce(inputs, op),
        Collective::AllGather => all_gather(inputs),
        Collective::ReduceScatter => reduce_scatter(inputs, op),
        Collective::AllToAll => all_to_all(inputs),
        Collective::Broadcast { root } => broadcast(inputs, root as usize),
        Collective::Reduce { root } => reduce(inputs, op, root as usize),
    }
}
