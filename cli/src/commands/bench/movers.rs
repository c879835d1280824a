//! `oxccl bench movers`: the TMA and SIMT movers' CTA sweep against `cuMemcpyDtoD`.

use super::{CliResult, check_timing, parse_size, print_json};
use crate::bench::{self, Split, SweepConfig};
use crate::progress::Progress;

/// Flags of `oxccl bench movers`.
#[derive(clap::Args, Clone, Debug)]
pub struct MoversArgs {
    /// Bytes of each buffer: the range every row moves (K, M, G suffixes are powers of 1024).
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size, allow_hyphen_values = true)]
    pub bytes: u64,
    /// One CTA count (default: the sweep's list, 1, 2, 4, 8, 16, 32, 66 and 132).
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// Timed launches per row, 1..=1000000.
    #[arg(short = 'n', long = "iters", default_value_t = 5, allow_negative_numbers = true)]
    pub iters: usize,
    /// Untimed launches before each row's timed ones, at most 1000000.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 2, allow_negative_numbers = true)]
    pub warmup: usize,
    /// Threads of the TMA CTAs that combine the reduce-add's sources (copies and bulk reductions run
    /// one warp).
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<u32>,
    /// TMA bytes per source per stage.
    #[arg(long, allow_negative_numbers = true)]
    pub chunk: Option<u32>,
    /// TMA stages (one issuer; 32 KiB stages as deep as shared memory allows for the copy with
    /// --chunk too left open, `auto_pipeline` for reduce-into, `combining_pipeline` for reduce-add).
    #[arg(long, allow_negative_numbers = true)]
    pub stages: Option<u32>,
    /// How the range is split between the CTAs: `contiguous` (one range per CTA), a size (pieces of
    /// that size dealt to the CTAs in turn; at least one per CTA), or `auto` (contiguous below 64
    /// CTAs, 4 MiB pieces from there where every CTA gets one).
    #[arg(long, value_parser = parse_split, default_value = "auto", allow_hyphen_values = true)]
    pub piece: Split,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// `--piece`: `auto`, `contiguous` or a size.
fn parse_split(s: &str) -> Result<Split, String> {
    match s.trim() {
        "auto" => Ok(Split::Auto),
        "contiguous" => Ok(Split::Contiguous),
        size => parse_size(size).map(Split::Pieces).map_err(|e| format!("{e}, or auto, or contiguous")),
    }
}

/// The sweep's configuration, checked (before any GPU is looked for).
pub fn check(a: &MoversArgs) -> Result<SweepConfig, Box<dyn std::error::Error>> {
    check_timing(a.iters, a.warmup)?;
    if let Split::Pieces(p) = a.piece
        && (p == 0 || !p.is_multiple_of(16))
    {
        return Err(format!("--piece {p}: give a positive multiple of 16 bytes").into());
    }
    let d = SweepConfig::default();
    let cfg = SweepConfig {
        bytes: a.bytes,
        ctas: a.ctas.map_or(d.ctas.clone(), |c| vec![c]),
        iters: a.iters,
        warmup: a.warmup,
        chunk_bytes: a.chunk,
        stages: a.stages,
        tma_threads_combine: a.threads.unwrap_or(d.tma_threads_combine),
        split: a.piece,
        ..d
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Runs the sweep and prints its table.
pub fn run(a: MoversArgs) -> CliResult {
    let cfg = check(&a)?;
    let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
    let stream = ctx.default_stream();
    println!("# oxccl mover sweep: {}", super::command_line());
    // Loaded here once and shared by the sweep's cases.
    let engine = oxccl::engine::Engine::shared(&ctx)?;
    println!("# device: {}, kernels from {}", ctx.name().unwrap_or_default(), engine.code);
    let given = |v: Option<u32>| v.map_or("default".to_string(), |v| v.to_string());
    println!(
        "# TMA pipeline: chunk {} B per source per stage, {} stages (default: the collectives' rule, two stages \
         of the largest chunk where the reduce-add combines in registers, 32 KiB stages as deep as shared \
         memory allows for the copy where neither is given; a given chunk cut where the sources' slots would not fit; each row \
         shows its chunk × stages)",
        given(cfg.chunk_bytes),
        given(cfg.stages)
    );
    match cfg.split {
        Split::Pieces(p) => println!("# each CTA moves {p}-byte pieces dealt in turn"),
        Split::Contiguous => println!("# each CTA moves one contiguous range"),
        Split::Auto => println!(
            "# each CTA moves one contiguous range below {} CTAs, {}-byte pieces dealt in turn from there \
             (where every CTA gets one)",
            Split::AUTO_PIECES_FROM,
            Split::AUTO_PIECE
        ),
    }
    let progress = Progress::new("movers", cfg.rows() as u64, a.json);
    let (memcpy, rows) = bench::mover_sweep(&stream, &cfg, |r| {
        progress.step(format!("{} {} {} CTAs", r.op, r.mover, r.ctas));
    })?;
    drop(progress);
    println!("# cuMemcpyDtoD {} B: {memcpy:.1} GB/s (read + written)", cfg.bytes);
    println!(
        "# {:<12} {:>5} {:>5} {:>8} {:>5} {:>13} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "op", "mover", "CTAs", "threads", "regs", "chunk×stages", "ms", "GB/s", "GB/s/CTA", "memcpy%", "piece"
    );
    for r in &rows {
        let pipeline = if r.stages == 0 { "-".to_string() } else { format!("{}×{}", r.chunk_bytes, r.stages) };
        println!(
            "  {:<12} {:>5} {:>5} {:>8} {:>5} {:>13} {:>10.3} {:>10.1} {:>10.1} {:>7.1}% {:>8}",
            r.op,
            r.mover,
            r.ctas,
            r.threads,
            r.registers,
            pipeline,
            r.ms,
            r.gbps,
            r.gbps_per_cta,
            100.0 * r.of_memcpy,
            if r.piece_bytes == 0 { "-".to_string() } else { r.piece_bytes.to_string() }
        );
    }
    print_json(&rows, a.json)
}
