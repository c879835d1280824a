//! Stage-ring state: the stage index and the mbarrier phase parity travel together, so a consumer
//! can never wait on the right stage with the wrong phase.

/// Position in a ring of `stages` stages, each guarded by one mbarrier whose phase flips on every use.
#[derive(Clone, Copy)]
pub struct PipelineState {
    /// The stage the next item uses.
    pub index: u32,
    /// Parity of that stage's mbarrier phase for the next item.
    pub phase: u32,
}

impl PipelineState {
    /// The state of a freshly initialised ring (every barrier in phase 0).
    #[inline(always)]
    pub const fn new() -> Self {
        PipelineState { index: 0, phase: 0 }
    }

    /// Moves to the next item.
    #[inline(always)]
    pub fn advance(&mut self, stages: u32) {
        self.index += 1;
        if self.index == stages {
            self.index = 0;
            self.phase ^= 1;
        }
    }

    /// Moves `n` items on (for threads that skip a task the issuer pipelines alone).
    #[inline(always)]
    pub fn advance_by(&mut self, n: u32, stages: u32) {
        let total = self.index + n % (2 * stages);
        let wraps = total / stages;
        self.index = total % stages;
        self.phase ^= wraps & 1;
    }
}
