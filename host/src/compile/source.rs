//! Where the compiler reads a program's ops: stored in a [`Program`], or computed on demand.
//!
//! The passes keep no copy of the ops: they read them in order ([`OpSource::try_for_each_op`]) or
//! by id ([`OpSource::op`]). A source that computes its ops
//! ([`Generated`](crate::program::generators::Generated), the built-in algorithms) therefore
//! compiles programs that would not fit in memory as a [`Program`]: the 8192-GPU HM AllReduce's
//! 134 M ops take 7 GB stored, nothing generated.

use crate::program::{BufferLayout, Op, OpId, Program, ProgramError};

/// A program's ops and what the compiler needs beside them. Shared by the compiler's threads, so
/// `Sync`.
pub trait OpSource: Sync {
    /// The program's name (the plan's).
    fn name(&self) -> &str;
    /// Buffer sizes and aliasing.
    fn layout(&self) -> &BufferLayout;
    /// Ranks per node the program was made for ([`Program::ranks_per_node`]).
    fn ranks_per_node(&self) -> Option<u32>;
    /// Number of ops.
    fn op_count(&self) -> usize;
    /// Op `id`, which is below [`OpSource::op_count`].
    fn op(&self, id: OpId) -> Op;
    /// Calls `f` with every op in order (faster than [`OpSource::op`] for each id); stops at the
    /// first `Err` and returns it.
    fn try_for_each_op<E>(&self, f: impl FnMut(OpId, &Op) -> Result<(), E>) -> Result<(), E>;
    /// The structural checks of [`Program::verify`] (a generated program is valid by
    /// construction: its checks are the name's and the layout's).
    fn verify(&self) -> Result<(), ProgramError>;
    /// Number of ranks.
    fn ranks(&self) -> u32 {
        self.layout().ranks
    }
}

impl OpSource for Program {
    fn name(&self) -> &str {
        &self.name
    }
    fn layout(&self) -> &BufferLayout {
        &self.layout
    }
    fn ranks_per_node(&self) -> Option<u32> {
        self.ranks_per_node
    }
    fn op_count(&self) -> usize {
        self.ops.len()
    }
    #[inline]
    fn op(&self, id: OpId) -> Op {
        self.ops[id.index()]
    }
    fn try_for_each_op<E>(&self, mut f: impl FnMut(OpId, &Op) -> Result<(), E>) -> Result<(), E> {
        self.ops.iter().enumerate().try_for_each(|(i, op)| f(OpId::new(i), op))
    }
    fn verify(&self) -> Result<(), ProgramError> {
        Program::verify(self)
    }
}
