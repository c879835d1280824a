//! `oxccl bench`: nccl-tests-style collective benchmarks and the mover CTA sweep.

use super::CliResult;
use crate::bench::{self, CollectiveBench, SweepConfig};
use crate::{Collective, Config, DType, Mover, ReduceOp, Reduction};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// all_reduce | reduce_scatter | all_gather | movers
    pub what: String,
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "1M", value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub factor: u64,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Check results in a separate untimed pass (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u8,
    /// Element type: float, half, bfloat16, int32, uint32.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: String,
    /// Reduction: sum, min, max.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Virtual ranks on the GPU.
    #[arg(long, default_value_t = 8)]
    pub ranks: usize,
    /// CTAs per rank (default: all SMs divided among the ranks, at most 16).
    #[arg(long)]
    pub ctas: Option<u32>,
    /// Data mover: tma or simt.
    #[arg(long, default_value = "tma")]
    pub mover: String,
    /// Reduction path: registers (deterministic) or tma (cp.reduce.async.bulk).
    #[arg(long, default_value = "registers")]
    pub reduction: String,
    /// Threads per CTA (default: chosen by the mover).
    #[arg(long)]
    pub threads: Option<u32>,
    /// Bytes per source per pipeline stage (TMA).
    #[arg(long)]
    pub chunk: Option<u32>,
    /// Pipeline stages (TMA).
    #[arg(long, default_value_t = 4)]
    pub stages: u32,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().map(|n| n * mult).map_err(|e| format!("{s:?} is not a size: {e}"))
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::ALL
        .iter()
        .copied()
        .find(|d| d.nccl_name() == s || format!("{d:?}").eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("unknown datatype {s:?} (float, half, bfloat16, int32, uint32)"))
}

fn parse_op(s: &str) -> Result<ReduceOp, String> {
    ReduceOp::ALL
        .iter()
        .copied()
        .find(|o| o.nccl_name() == s)
        .ok_or_else(|| format!("unknown op {s:?} (sum, min, max)"))
}

fn parse_mover(s: &str) -> Result<Mover, String> {
    match s {
        "tma" => Ok(Mover::Tma),
        "simt" => Ok(Mover::Simt),
        _ => Err(format!("unknown mover {s:?} (tma, simt)")),
    }
}

pub fn run(a: Args) -> CliResult {
    let collective = match a.what.as_str() {
        "all_reduce" => Some(Collective::AllReduce),
        "reduce_scatter" => Some(Collective::ReduceScatter),
        "all_gather" => Some(Collective::AllGather),
        "movers" => None,
        other => {
            return Err(format!("unknown benchmark {other:?}: all_reduce, reduce_scatter, all_gather or movers").into());
        }
    };
    let command: Vec<String> = std::env::args().collect();
    let ctx = crate::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
    let stream = ctx.default_stream();
    let Some(collective) = collective else {
        let d = SweepConfig::default();
        let cfg =
            SweepConfig { bytes: a.max_bytes, chunk_bytes: a.chunk.unwrap_or(d.chunk_bytes), stages: a.stages, ..d };
        println!("# oxccl mover sweep: {}", command.join(" "));
        println!("# device: {}", ctx.name().unwrap_or_default());
        let (memcpy, rows) = bench::mover_sweep(&stream, &cfg)?;
        println!("# cuMemcpyDtoD {} B: {memcpy:.1} GB/s (read + written)", cfg.bytes);
        println!(
            "# {:<12} {:>5} {:>5} {:>8} {:>5} {:>10} {:>10} {:>10} {:>8}",
            "op", "mover", "CTAs", "threads", "regs", "ms", "GB/s", "GB/s/CTA", "memcpy%"
        );
        for r in &rows {
            println!(
                "  {:<12} {:>5} {:>5} {:>8} {:>5} {:>10.3} {:>10.1} {:>10.1} {:>7.1}%",
                r.op,
                r.mover,
                r.ctas,
                r.threads,
                r.registers,
                r.ms,
                r.gbps,
                r.gbps_per_cta,
                100.0 * r.of_memcpy
            );
        }
        if a.json {
            for r in &rows {
                println!("{}", serde_json::to_string(r)?);
            }
        }
        return Ok(());
    };
    let mover = parse_mover(&a.mover)?;
    let reduction = match a.reduction.as_str() {
        "registers" => Reduction::Registers,
        "tma" => Reduction::Tma,
        other => return Err(format!("unknown reduction {other:?} (registers, tma)").into()),
    };
    let config = Config {
        max_ctas: a.ctas,
        mover,
        reduction,
        deterministic: reduction == Reduction::Registers,
        chunk_bytes: a.chunk,
        stages: a.stages,
        threads: a.threads,
        ..Config::default()
    };
    let b = CollectiveBench {
        collective,
        dtype: parse_dtype(&a.dtype)?,
        op: parse_op(&a.op)?,
        ranks: a.ranks,
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        iters: a.iters,
        warmup: a.warmup,
        check: a.check != 0,
        config,
    };
    println!("# oxccl {}: {}", collective.name(), command.join(" "));
    println!(
        "# device: {}, {} virtual ranks, mover {}, reduction {}",
        ctx.name().unwrap_or_default(),
        a.ranks,
        a.mover,
        a.reduction
    );
    println!("{}", bench::NCCL_HEADER);
    let rows = bench::collective_bench(&stream, &b, |r| println!("{}", bench::nccl_line(r)))?;
    println!("{}", bench::nccl_footer(&rows));
    if a.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    }
    if rows.iter().any(|r| (r.oop_wrong != 0 && r.oop_wrong != u64::MAX) || (r.ip_wrong != 0 && r.ip_wrong != u64::MAX))
    {
        return Err("wrong results (see #wrong)".into());
    }
    Ok(())
}
