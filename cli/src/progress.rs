//! Progress bars on stderr for the long runs: the benchmarks' sweeps (per size, row, configuration
//! or program), large compiles and verifications.
//!
//! A bar is drawn only where stderr is a terminal and the command was not asked for JSON (`--json`
//! output is for programs). Lines the run prints while a bar shows go through
//! [`Progress::println`], which takes the bar down, prints the line on stdout and puts the bar
//! back, so the table and the bar never share a line; dropping the bar clears it, on success and on
//! an early error alike.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::borrow::Cow;
use std::cell::Cell;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How long work runs before a [`Progress::after`] bar appears: less shows no bar.
pub const LONG_RUN: Duration = Duration::from_secs(1);

/// How often a shown bar redraws while a step runs (the elapsed time keeps moving).
const TICK: Duration = Duration::from_millis(250);

/// A progress bar on stderr, or nothing where none is wanted. Steps are counted from the loop that
/// runs them, through [`Progress::step`].
pub struct Progress {
    bar: ProgressBar,
    /// Set for a bar that is drawn only once a step ends this long after the start
    /// ([`Progress::after`]): (start, delay).
    pending: Cell<Option<(Instant, Duration)>>,
}

impl Progress {
    /// A bar of `steps` steps named `what`, drawn at once on stderr where it is a terminal, unless
    /// `hide` (the command's `--json`).
    pub fn new(what: &str, steps: u64, hide: bool) -> Self {
        let p = Self::hidden_bar(what, steps);
        if !hide && std::io::stderr().is_terminal() {
            p.show();
        }
        p
    }

    /// As [`Progress::new`], but drawn only from the first step that ends `delay` or more after
    /// now: work that finishes sooner (a small compile, a quick verification) shows no bar.
    pub fn after(what: &str, steps: u64, hide: bool, delay: Duration) -> Self {
        let p = Self::hidden_bar(what, steps);
        if !hide && std::io::stderr().is_terminal() {
            p.pending.set(Some((Instant::now(), delay)));
        }
        p
    }

    /// No bar: [`Progress::println`] prints, everything else does nothing.
    pub fn hidden() -> Self {
        Self::hidden_bar("", 0)
    }

    fn hidden_bar(what: &str, steps: u64) -> Self {
        let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed} (eta {eta}) {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::hidden())
            .with_style(style)
            .with_prefix(what.to_owned());
        Progress { bar, pending: Cell::new(None) }
    }

    fn show(&self) {
        self.bar.set_draw_target(ProgressDrawTarget::stderr());
        self.bar.enable_steady_tick(TICK);
    }

    /// One step done; `done` names it beside the bar (`16777216 B`, `tma 8 CTAs`).
    pub fn step(&self, done: impl Into<Cow<'static, str>>) {
        // Shown only while steps remain: a bar that would appear on the last step is noise.
        let remaining = self.bar.length().unwrap_or(0).saturating_sub(self.bar.position() + 1);
        if let Some((start, delay)) = self.pending.get()
            && remaining > 0
            && start.elapsed() >= delay
        {
            self.pending.set(None);
            // The steps so far came after a long start (a compile's passes before its first rank):
            // no rate to project from.
            self.bar.reset_eta();
            self.show();
        }
        self.bar.set_message(done);
        self.bar.inc(1);
    }

    /// Prints `line` on stdout with the bar taken down meanwhile.
    pub fn println(&self, line: impl std::fmt::Display) {
        self.bar.suspend(|| println!("{line}"));
    }

    /// Whether the bar is drawn now.
    pub fn is_shown(&self) -> bool {
        !self.bar.is_hidden()
    }
}

impl Drop for Progress {
    /// Clears the bar: what follows on the terminal starts on a clean line.
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests run without a terminal on stderr (or with `hide`): no bar, and stepping past the end
    /// or printing through it is harmless.
    #[test]
    fn a_bar_without_a_terminal_is_hidden_and_harmless() {
        for p in
            [Progress::new("sweep", 2, true), Progress::after("compile", 2, true, Duration::ZERO), Progress::hidden()]
        {
            assert!(!p.is_shown());
            for i in 0..4 {
                p.step(format!("step {i}"));
            }
            p.println("a line");
        }
    }
}
